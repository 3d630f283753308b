"""The launcher's ``--info`` and ``--mesh``, failures under it, and ``DTENSOR_LOG``.

Jobs run through ``python -m launch`` in a subprocess with a hard limit, from the
repository root (so that ``dtensor`` is importable by the ranks).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.jobs import child_env, run_group

from launch._info import collect_info, format_info

LIMIT_S = 90


def _run(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "launch", *args]
    return run_group(argv, tmp_path, LIMIT_S, child_env(env, drop=["DTENSOR_MESH"]))


def _script(tmp_path: Path, text: str) -> str:
    (tmp_path / "prog.py").write_text(textwrap.dedent(text))
    return "prog.py"


# --- --info ---------------------------------------------------------------------------------


def test_info_lists_mpi_gpu_and_fastpath(tmp_path):
    out = _run(["--info"], tmp_path)
    assert out.returncode == 0, out.stderr
    from mpi4py import MPI

    import fastpath

    lines = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.stdout.splitlines())
    first = MPI.Get_library_version().strip().splitlines()[0].strip()
    assert lines["MPI library"] == first
    assert lines["MPI standard"] == "{}.{}".format(*MPI.Get_version())
    assert lines["CUDA-aware MPI"] in ("yes", "no", "unknown")
    assert lines["fast path"].startswith("compiled" if fastpath.AVAILABLE else "NOT BUILT")
    from redistribute import shm

    assert lines["shared memory"].startswith("on (" if shm.enabled() else "off (")
    assert lines["cupy"] == "not installed" or re.match(r"\d+\.", lines["cupy"])
    assert Path(lines["mpiexec"]).name in ("mpiexec", "mpirun", "mpiexec.hydra")


#: Run ``code`` as a program whose import of the compiled extension fails, as in a source
#: checkout that was never built.
UNBUILT = ("import sys, warnings; warnings.simplefilter('ignore'); "
           "sys.modules['fastpath._strides'] = None\n")


@pytest.mark.parametrize("fastpath_env", [None, "0"])
def test_info_and_benchmarks_refuse_an_unbuilt_fast_path_loudly(tmp_path, fastpath_env):
    # run from a checkout without the extension, a benchmark measured the Python path and
    # --info said "not built" in one quiet line; DTENSOR_FASTPATH=0 is the path on purpose
    # (the Python-path test stage exports DTENSOR_FASTPATH=0: the None case must not see it)
    env = child_env({} if fastpath_env is None else {"DTENSOR_FASTPATH": fastpath_env},
                    drop=["DTENSOR_FASTPATH"] if fastpath_env is None else [])
    bench = UNBUILT + (
        "sys.argv = ['small_ops', '--repeat', '1']\n"
        "import launch.bench._common\n"
        "print('MEASURING')\n"
    )
    out = subprocess.run([sys.executable, "-c", bench], cwd=tmp_path, env=env, check=False,
                         capture_output=True, text=True, timeout=LIMIT_S)
    main = "from launch.__main__ import main; sys.exit(main(['--info']))"
    info = subprocess.run([sys.executable, "-c", UNBUILT + main], cwd=tmp_path, env=env,
                          check=False, capture_output=True, text=True, timeout=LIMIT_S)
    assert info.returncode == 0, info.stderr
    if fastpath_env is None:
        assert out.returncode == 2 and "MEASURING" not in out.stdout, out.stdout + out.stderr
        assert "refusing to measure" in out.stderr and "NOT BUILT" in out.stderr
        assert "pip install -e ." in out.stderr and "DTENSOR_FASTPATH=0" in out.stderr
        assert "WARNING: dtensor's compiled fast path is NOT BUILT" in info.stderr
        assert "!!!!!" in info.stderr
    else:
        assert out.returncode == 0 and "MEASURING" in out.stdout, out.stderr
        assert "WARNING" not in info.stderr
    assert re.search(r"fast path\s+NOT BUILT in ", info.stdout), info.stdout


def test_info_says_when_shared_memory_is_off(tmp_path):
    out = _run(["--info"], tmp_path, {"DTENSOR_SHM": "0"})
    assert out.returncode == 0, out.stderr
    assert "shared memory" in out.stdout and "off (DTENSOR_SHM=0)" in out.stdout


def test_collect_info_agrees_with_format():
    info = collect_info()
    text = format_info(info)
    assert str(info["gpus"]) in text and info["mpi4py"] in text
    if info["cupy"] is None:
        assert info["gpus"] == 0


# --- --mesh ---------------------------------------------------------------------------------

MESH_PROG = """\
import os
import dtensor as dt
mesh = dt.init_device_mesh()
print(f"rank {mesh.get_rank()} mesh {mesh.shape} env {os.environ['DTENSOR_MESH']} "
      f"omp {os.environ['OMP_NUM_THREADS']}")
"""


def test_mesh_is_exported_and_sets_the_rank_count(tmp_path):
    out = _run(["--mesh", "2x2", _script(tmp_path, MESH_PROG)], tmp_path)
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    assert lines == [f"rank {r} mesh (2, 2) env 2x2 omp 1" for r in range(4)]


def test_mesh_with_matching_n_and_other_spellings(tmp_path):
    out = _run(["-n", "2", "--mesh", "1,2", _script(tmp_path, MESH_PROG)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [
        f"rank {r} mesh (1, 2) env 1x2 omp 1" for r in (0, 1)
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "3", "--mesh", "2x2"], "needs 4 ranks but -n is 3"),
        (["--mesh", "2xa"], "--mesh must look like 2x2"),
        (["--mesh", "0x2"], "--mesh must look like 2x2"),
    ],
)
def test_bad_mesh_exits_2(tmp_path, args, message):
    out = _run([*args, _script(tmp_path, MESH_PROG)], tmp_path)
    assert out.returncode == 2
    assert message in out.stderr


# --- failures under a mesh job --------------------------------------------------------------


def test_rank_failing_in_dtensor_code_ends_the_job_once(tmp_path):
    prog = _script(
        tmp_path,
        """\
        import numpy as np
        import dtensor as dt
        mesh = dt.init_device_mesh()
        x = dt.distribute_tensor(np.ones((4, 4), np.float32), mesh, [dt.Shard(0), dt.Shard(1)])
        if mesh.get_rank() == 2:
            x.redistribute(mesh, [dt.Shard(7), dt.Replicate()])  # invalid: raises here only
        x.full_tensor()  # the other ranks wait in a collective
        """,
    )
    out = _run(["--mesh", "2x2", "--timeout", "60", prog], tmp_path)
    # the job ended by its own abort: exit status 1, not the timeout's 124
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("Traceback (most recent call last)") == 1
    assert "[rank 2] Traceback" in out.stderr
    assert "[rank 2] placements.errors.ShardDimError: Shard(dim=7) is out of range" in out.stderr


# --- DTENSOR_LOG ----------------------------------------------------------------------------

LOG_PROG = """\
import numpy as np
import dtensor as dt
import dtensor.debug._log  # noqa: F401  (configures logging from DTENSOR_LOG)
mesh = dt.init_device_mesh()
x = dt.distribute_tensor(np.ones((4, 6), np.float32), mesh, [dt.Shard(1)])
w = dt.distribute_tensor(np.ones((6, 2), np.float32), mesh, [dt.Replicate()])
for _ in range(2):
    y = x @ w
"""


def test_dtensor_log_debug_logs_misses_hits_plans_and_collectives(tmp_path):
    out = _run(["-n", "2", _script(tmp_path, LOG_PROG)], tmp_path, env={"DTENSOR_LOG": "debug"})
    assert out.returncode == 0, out.stderr
    err = out.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] dtensor DEBUG: prop cache miss: matmul:" in err
        assert f"[rank {rank}] dtensor DEBUG: prop cache hit: matmul" in err
    # the miss names the plan of the moved weight (R -> S(0), a local chunk)
    assert "input 1: R -> S(0): local_chunk" in err
    assert "collective" in err


def test_dtensor_log_unset_or_warning_is_quiet(tmp_path):
    for env in ({}, {"DTENSOR_LOG": "warning"}):
        out = _run(["-n", "2", _script(tmp_path, LOG_PROG)], tmp_path, env=env)
        assert out.returncode == 0, out.stderr
        assert "dtensor DEBUG" not in out.stderr


def test_dtensor_log_rejects_unknown_level(tmp_path):
    out = _run(["-n", "1", _script(tmp_path, LOG_PROG)], tmp_path, env={"DTENSOR_LOG": "loud"})
    assert out.returncode == 1
    assert "DTENSOR_LOG='loud' is not a logging level" in out.stderr
