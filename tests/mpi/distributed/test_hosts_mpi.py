"""Ranks on several hosts, simulated on one machine (``DTENSOR_SIM_HOSTS``): meshes know
which dims cross hosts, node-shared memory is used only within a host, node-local ranks
count within a host. Each stage sets the knob in-process for the first test; the unit job
``tests/unit/distributed/test_two_hosts_job.py`` runs this file (and the redistribute pairs,
the op table and the checkpoint tests) at 4 ranks as two hosts of 2 from the start."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from redistribute import comm as _comm
from redistribute import hosts, shm

WORLD = MPI.COMM_WORLD
R, S = dt.Replicate(), dt.Shard

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.mode_independent]  # below dispatch


@contextlib.contextmanager
def simulated(n: int):
    """``DTENSOR_SIM_HOSTS=n`` on every rank; afterwards the old value, and a mesh created
    again so that the table of hosts is this machine's again."""
    old = os.environ.get(hosts.SIM_HOSTS_VAR)
    os.environ[hosts.SIM_HOSTS_VAR] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(hosts.SIM_HOSTS_VAR, None)
        else:
            os.environ[hosts.SIM_HOSTS_VAR] = old
        dt.init_device_mesh((WORLD.size,))


def test_two_simulated_hosts_split_meshes_shared_memory_and_local_ranks():
    w, r = WORLD.size, WORLD.rank
    world = _comm.world()
    with simulated(2):
        first = next(j for j in range(w) if j * 2 // w == r * 2 // w)  # my host's first rank
        mesh = dt.init_device_mesh((w,))
        assert mesh.dim_spans_hosts == (True,)
        assert _comm.local_rank(world) == r - first
        assert shm.probe(world) is False  # never across hosts, though this machine could
        if w % 2 == 0:
            mesh2 = dt.init_device_mesh((2, w // 2), mesh_dim_names=("host", "local"))
            assert mesh2.dim_spans_hosts == (True, False)
            assert mesh2["local"].dim_spans_hosts == (False,)
            inside = shm.probe(mesh2._dim_comms[1])  # inside one host: shared where it can be
            assert inside is shm.enabled() and (inside or not shm.requested())
            across = dt.DeviceMesh("cpu", np.arange(w).reshape(2, w // 2).T)
            assert across.dim_spans_hosts == (False, True)
    job = hosts.simulated_host(r, w)  # the job's own setting, back in force
    assert dt.init_device_mesh((w,)).dim_spans_hosts == (job is not None,)
    if job is None:
        assert _comm.local_rank(world) == WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def test_a_large_gather_crosses_hosts_through_mpi_only():
    """An exchange big enough for the shared path: values right everywhere; over a dim that
    crosses hosts, no shared-memory exchange ran (under the job's simulated hosts)."""
    mesh = dt.init_device_mesh((WORLD.size,))
    a = np.random.default_rng(3).standard_normal((1031, 517)).astype(np.float32)
    before = dict(shm.counts)
    x = dt.distribute_tensor(a, mesh, [S(0)])
    np.testing.assert_array_equal(x.redistribute(mesh, [R]).to_local().numpy(), a)
    gained = {k: v - before.get(k, 0) for k, v in shm.counts.items() if v != before.get(k, 0)}
    if mesh.dim_spans_hosts[0]:
        assert not any(not k.endswith("fallback") for k in gained), gained
