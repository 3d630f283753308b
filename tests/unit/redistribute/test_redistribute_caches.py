"""The memo tables of redistribute/ are registered caches (one process, COMM_SELF).

Plans, compiled programs and reduce-op lookups fill their caches, and
``placements.cache.clear_all()`` empties them (a cleared program frees its datatypes);
results are the same afterwards, only recomputed.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from placements import DTensorSpec, MeshShape, Partial, Replicate, Shard
from placements.cache import clear_all, get_cache
from redistribute import comm as C
from redistribute import execute as E
from redistribute.execute import programs as EP
from redistribute.plan import plan

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py


def _spec(placements, shape=(8, 6), mesh=(2, 2)):
    return DTensorSpec(MeshShape(mesh), tuple(placements), shape, np.dtype(np.float32))


def test_plans_fill_their_cache_and_clear_all_empties_it():
    plans = get_cache("redistribute.plans")
    spec = _spec([Shard(0), Partial()], shape=(13, 7))
    first = plan(spec, [Replicate(), Shard(1)])
    size, hits = plans.stats()["size"], plans.stats()["hits"]
    assert size >= 1
    assert plan(spec, [Replicate(), Shard(1)]) is first
    assert plans.stats()["hits"] == hits + 1
    clear_all()
    assert plans.stats()["size"] == 0
    again = plan(spec, [Replicate(), Shard(1)])
    assert again == first and again is not first
    assert plans.stats()["size"] == 1


def test_programs_fill_their_cache_and_clear_all_frees_them(monkeypatch):
    programs = get_cache("redistribute.programs")
    assert programs is EP.PROGRAMS
    comm = C.Comm(MPI.COMM_SELF, mesh_dim=0)
    spec = _spec([Shard(0)], shape=(11, 3), mesh=(1,))
    local = np.arange(33, dtype=np.float32).reshape(11, 3)
    steps = plan(spec, [Replicate()])
    clear_all()
    out = E.execute(steps, local, spec, (0,), [comm])
    np.testing.assert_array_equal(out, local)
    assert len(programs) == 1 and programs.stats()["misses"] == 1
    E.execute(steps, local, spec, (0,), [comm])
    assert len(programs) == 1 and programs.stats()["misses"] == 1  # compiled once
    assert programs.stats()["hits"] == 1
    freed = []
    monkeypatch.setattr(C, "free_types", lambda types: freed.append(list(types)))
    clear_all()
    assert len(programs) == 0 and freed == [[]]  # released (no derived type on one rank)
    np.testing.assert_array_equal(E.execute(steps, local, spec, (0,), [comm]), local)
    assert len(programs) == 1


def test_reduce_op_lookups_fill_their_cache_and_clear_all_empties_it():
    reductions = get_cache("redistribute.reductions")
    comm = C.Comm(MPI.COMM_SELF)
    x = np.arange(5, dtype=np.int16)
    comm.allreduce(x, None, "min")
    assert (np.dtype(np.int16), "min") in reductions
    clear_all()
    assert len(reductions) == 0
    comm.allreduce(x, None, "min")
    np.testing.assert_array_equal(x, np.arange(5, dtype=np.int16))
    assert (np.dtype(np.int16), "min") in reductions
    assert reductions.stats()["misses"] == 1
    comm.allreduce(x, None, "min")
    assert reductions.stats()["hits"] == 1
