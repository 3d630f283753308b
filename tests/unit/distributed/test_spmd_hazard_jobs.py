"""SPMD hazards of DTensor in a real 2-rank job: what one rank may call alone.

The job (an ``mpiexec -n 2`` program in its own process group, killed when it outlives
its limit, so that a hang fails the test) has rank 0 alone call every hazard on a sharded
DTensor: ``repr``/``print``/``len``/shape queries and iteration over an unsharded dim
return at once; numpy conversion, numpy functions and ufuncs, pickling, iteration over a
sharded dim and ``bool`` of several elements raise typed errors at once. None of them may
communicate: had one entered a collective, rank 0 would wait for rank 1 forever. Then
every rank calls the collective conversions (``item``, ``bool``, ``float``, ``int``,
``tolist``, ``in``) and every rank reports the same values.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.jobs import MPIEXEC, child_env, run_group

LIMIT_S = 60

pytestmark = pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="no mpiexec next to python")

JOB = """\
import io, pickle, contextlib
import numpy as np
from mpi4py import MPI
import dtensor as dt
from dtensor.errors import DTypeError, ValueConversionError

world = MPI.COMM_WORLD
rank = world.Get_rank()
mesh = dt.init_device_mesh((2,))
x = dt.distribute_tensor(np.arange(10.0).reshape(5, 2), mesh, [dt.Shard(0)])
rows = dt.distribute_tensor(np.arange(10.0).reshape(5, 2), mesh, [dt.Shard(1)])
if rank == 0:
    done = []
    with contextlib.redirect_stdout(io.StringIO()):
        print(x)
    done.append(f"repr:{len(repr(x)) > 0}")
    done.append(f"len:{len(x)}:{x.size(1)}:{x.numel()}:{x.ndim}:{x.shape[0]}:{x.stride(0)}")
    done.append(f"iter:{len(list(rows))}")
    hazards = {
        "asarray": lambda: np.asarray(x),
        "exp": lambda: np.exp(x),
        "mean": lambda: np.mean(x),
        "pickle": lambda: pickle.dumps(x),
        "iter": lambda: list(x),
        "bool": lambda: bool(x),
        "item": lambda: x.item(),
    }
    for name, fn in hazards.items():
        try:
            fn()
        except (DTypeError, ValueConversionError) as e:
            done.append(f"{name}:{type(e).__name__}")
        else:
            done.append(f"{name}:returned")
    print("rank 0 alone: " + " ".join(done), flush=True)
world.Barrier()
s = x.sum()
vals = [s.item(), float(s), int(s), bool(s > 40), bool(s > 50), 9.0 in x, x.tolist()[4]]
print(f"rank {rank} collective: {vals}", flush=True)
"""


def test_one_rank_hazards_raise_or_return_at_once_and_collectives_agree(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = child_env({"OMP_NUM_THREADS": "1"})
    out = run_group([MPIEXEC, "-n", "2", sys.executable, str(script)], tmp_path, LIMIT_S, env)
    assert out.returncode == 0, out.stdout + out.stderr
    alone = re.search(r"rank 0 alone: (.*?item:\w+)", out.stdout)
    assert alone, out.stdout + out.stderr
    assert alone.group(1).split() == [
        "repr:True",
        "len:5:2:10:2:5:2",
        "iter:5",
        "asarray:DTypeError",
        "exp:DTypeError",
        "mean:DTypeError",
        "pickle:DTypeError",
        "iter:DTypeError",
        "bool:ValueConversionError",
        "item:ValueConversionError",
    ]
    # each rank's report, wherever the other rank's output arrived in between
    reports = re.findall(r"rank (\d) collective: (\[.*?\]\])", out.stdout)
    assert sorted(r for r, _ in reports) == ["0", "1"], out.stdout + out.stderr
    for _, vals in reports:
        assert vals == "[45.0, 45.0, 45, True, False, True, [8.0, 9.0]]"
