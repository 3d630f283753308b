"""The shared cache helper (placements.cache) and the Partial fill rule (one process)."""

from __future__ import annotations

import itertools
import math

import pytest

from placements import Partial, Replicate, Shard
from placements.cache import LRUCache, all_stats, clear_all, get_cache, memoize
from placements.errors import ConfigError
from placements.layout import partial_fill

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

_names = itertools.count()


def _name() -> str:
    return f"test.cache.{next(_names)}"


def test_lru_evicts_least_recently_used_and_counts():
    evicted = []
    c = LRUCache(_name(), 2, on_evict=lambda k, v: evicted.append((k, v)))
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # a is now the most recent
    c.put("c", 3)
    assert evicted == [("b", 2)]
    assert "b" not in c and "a" in c and "c" in c
    assert c.get("b", "none") == "none"
    assert c.stats() == {"hits": 1, "misses": 1, "evictions": 1, "size": 2, "maxsize": 2}


def test_lru_resize_clear_and_hooks():
    evicted, cleared = [], []
    c = LRUCache(_name(), 4, on_evict=lambda k, v: evicted.append(k),
                 on_clear=lambda: cleared.append(True))
    for k in range(4):
        c.put(k, k)
    c.resize(2)
    assert evicted == [0, 1] and list(c.data) == [2, 3] and cleared == [True]
    c.get(2)
    c.clear()
    assert len(c) == 0 and evicted == [0, 1, 3, 2] and len(cleared) == 2  # 2 was used last
    assert c.stats()["hits"] == 0 and c.stats()["evictions"] == 0
    with pytest.raises(ConfigError, match="at least 1"):
        c.resize(0)


def test_registry_names_are_unique_and_clear_all_empties_everything():
    name = _name()
    c = LRUCache(name, 8)
    with pytest.raises(ConfigError, match="already registered"):
        LRUCache(name, 8)
    assert get_cache(name) is c
    with pytest.raises(ConfigError, match="no cache named"):
        get_cache("no.such.cache")

    calls = []

    @memoize(_name(), 8)
    def square(x):
        calls.append(x)
        return x * x

    c.put(1, 1)
    assert square(3) == 9 and square(3) == 9 and calls == [3]
    stats = all_stats()
    assert stats[name]["size"] == 1
    memo_stats = [s for s in stats.values() if s["hits"] == 1 and s["misses"] == 1]
    assert memo_stats, stats
    clear_all()
    assert len(c) == 0 and square.cache_info().currsize == 0
    assert square(3) == 9 and calls == [3, 3]


_ONE_DIM = [(Partial(op),) for op in ("sum", "prod", "avg", "max", "min")]
_TWO_DIM = [
    (Partial("sum"), Partial("prod")), (Partial("prod"), Partial("sum")),
    (Partial("max"), Partial("sum")), (Partial("sum"), Partial("max")),
    (Shard(0), Partial("prod")), (Replicate(), Partial("sum")),
    (Partial("avg"), Partial("prod")), (Partial("prod"), Partial("prod")),
]


@pytest.mark.parametrize(
    ("mesh", "placements"),
    [(m, p) for m in ((2,), (3,)) for p in _ONE_DIM]
    + [(m, p) for m in ((2, 2), (2, 3)) for p in _TWO_DIM],
)
def test_partial_fill_reduces_back_to_the_value(mesh, placements):
    value = 3.0
    ops = {"sum": sum, "prod": math.prod, "avg": lambda v: sum(v) / len(v), "max": max,
           "min": min}

    def held(coord):
        fill = partial_fill(placements, coord)
        return value if fill is None else float(fill)

    def reduce(prefix, m):
        # Partial values reduce from the highest mesh dim down to mesh dim 0
        if m == len(mesh):
            return held(prefix)
        vals = [reduce(prefix + (c,), m + 1) for c in range(mesh[m])]
        p = placements[m]
        return ops[p.reduce_op](vals) if p.is_partial() else vals[0]

    assert reduce((), 0) == value
    assert partial_fill(placements, (0,) * len(mesh)) is None
