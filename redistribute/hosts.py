"""Which host each rank runs on: the identity of this machine, the test knob that splits one
machine into simulated hosts, and the table of hosts per world rank that meshes and the
cost model read.

Two ranks are on one host when they can share memory: node-shared segments
(:mod:`redistribute.shm`) are used only among them, and a collective whose group holds ranks
of several hosts crosses the network, the slower of the cost model's two link tiers
(:class:`redistribute.cost.CostModel`'s ``inter_host``).

Test knob: ``DTENSOR_SIM_HOSTS=N`` splits the world ranks into ``N`` simulated hosts of
consecutive ranks (rank ``r`` of ``W`` is on simulated host ``r * N // W``), as if each
group ran on a machine of its own. Shared memory, node-local ranks and the cost model then
treat the groups as separate hosts, so a multi-host job can be tested on one machine
(``DTENSOR_SIM_HOSTS=2 python -m launch -n 4 ...``). Every rank must see the same value.

Pure: no communication (:func:`note_hosts` records what a collective of the caller
gathered).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable

import numpy as np

from placements.env import env_int
from placements.errors import ConfigError

__all__ = [
    "SIM_HOSTS_VAR",
    "host_id",
    "hosts_of",
    "note_hosts",
    "simulated_host",
    "spans_hosts",
    "spans_of",
]

SIM_HOSTS_VAR = "DTENSOR_SIM_HOSTS"

# world rank -> host id, from the all-gathers that start mesh creations
_hosts: dict[int, int] = {}
# (shape, bytes) of a grid of world ranks -> spans_hosts' answer, while the hosts stand
_spans: dict[tuple, tuple[bool, ...]] = {}


def simulated_host(world_rank: int, world_size: int) -> int | None:
    """The simulated host of ``world_rank`` under ``DTENSOR_SIM_HOSTS``, or None when the
    knob is unset (or 1). **Local**."""
    n = env_int(SIM_HOSTS_VAR, 1, minimum=1)
    if n > world_size:
        raise ConfigError(
            f"{SIM_HOSTS_VAR}={n}: more simulated hosts than the job's {world_size} ranks"
        )
    return None if n == 1 else world_rank * n // world_size


@functools.cache
def _machine() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read()
    except OSError:
        boot = b""
    return boot + os.uname().nodename.encode()


def host_id(world_rank: int, world_size: int) -> int:
    """A number below 2**62 that differs between hosts (boot id and host name of this
    machine, and the simulated host of :func:`simulated_host`). **Local**."""
    return _host_id(world_rank, world_size, os.environ.get(SIM_HOSTS_VAR, ""))


@functools.lru_cache(maxsize=8)
def _host_id(world_rank: int, world_size: int, _knob: str) -> int:
    sim = simulated_host(world_rank, world_size)
    extra = b"" if sim is None else f"/sim{sim}".encode()
    digest = hashlib.blake2b(_machine() + extra, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def note_hosts(world_ranks: Iterable[int], ids: Iterable[int]) -> None:
    """Record the host of each world rank (gathered by the caller's collective). **Local**."""
    for r, h in zip(np.asarray(world_ranks).tolist(), ids):
        if _hosts.get(r) != h:
            _hosts[r] = h
            _spans.clear()  # a host changed (a test's simulated hosts): answers change


def hosts_of(world_ranks: np.ndarray) -> np.ndarray | None:
    """The host ids of ``world_ranks`` (same shape), or None when one is not known. **Local**."""
    grid = np.asarray(world_ranks)
    ids = [_hosts.get(r) for r in grid.ravel().tolist()]
    if None in ids:
        return None
    return np.array(ids, dtype=np.int64).reshape(grid.shape)


def spans_hosts(world_grid: np.ndarray) -> tuple[bool, ...]:
    """Per dim of a mesh of world ranks: whether some group of that dim holds ranks of more
    than one host (its collectives cross the network). All False when a host is not known
    (a mesh whose ranks were never gathered). **Local**."""
    grid = np.asarray(world_grid)
    key = (grid.shape, grid.tobytes())
    found = _spans.get(key)
    if found is not None:
        return found
    hosts = hosts_of(grid) if grid.size else None
    if hosts is None:
        return (False,) * grid.ndim
    found = spans_of(hosts)
    if len(_spans) < 4096:
        _spans[key] = found
    return found


def spans_of(host_grid: np.ndarray) -> tuple[bool, ...]:
    """Per dim of a mesh given as the host of each position: whether some group of that dim
    holds more than one host. **Local**."""
    hosts = np.asarray(host_grid)
    out = []
    for m in range(hosts.ndim):
        groups = np.moveaxis(hosts, m, -1).reshape(-1, hosts.shape[m])
        out.append(bool((groups != groups[:, :1]).any()))
    return tuple(out)
