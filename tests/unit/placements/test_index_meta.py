"""placements.index_meta.index_plan against numpy's indexing: the output shape, the dims
kept whole, and the errors, on random basic and advanced keys."""

from __future__ import annotations

import random

import numpy as np
import pytest

from placements.errors import DimError, DTensorError, DTypeError
from placements.index_meta import index_plan

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py


def _random_key(r: random.Random, rng: np.random.Generator, shape: tuple) -> tuple:
    key: list = []
    d = 0
    while d < len(shape) and r.random() < 0.8:
        kind, n = r.randrange(6), shape[d]
        if kind == 0:
            key.append(slice(None))
            d += 1
        elif kind == 1:
            key.append(slice(1, None, 2))
            d += 1
        elif kind == 2 and n:
            key.append(r.randrange(-n, n))
            d += 1
        elif kind == 3:
            key.append(None)
        elif kind == 4 and n:
            key.append(rng.integers(-n, n, tuple(r.randrange(1, 3) for _ in range(r.randrange(1, 3)))))
            d += 1
        elif kind == 5:
            m = r.randrange(1, len(shape) - d + 1)
            if all(shape[d : d + m]):  # numpy takes an empty mask as an integer index
                key.append(rng.random(shape[d : d + m]) < 0.5)
                d += m
    if r.random() < 0.3:
        key.insert(r.randrange(len(key) + 1), Ellipsis)
    return tuple(key)


def test_index_plan_matches_numpy():
    rng = np.random.default_rng(0)
    checked = 0
    for seed in range(1500):
        r = random.Random(seed)
        shape = tuple(r.randrange(0, 5) for _ in range(r.randrange(1, 4)))
        key = _random_key(r, rng, shape)
        try:
            want = np.zeros(shape)[key].shape
        except IndexError:  # index arrays that do not broadcast together
            with pytest.raises(DTensorError):
                index_plan(shape, key)
            continue
        out, kept, _ = index_plan(shape, key)
        assert out == want, (shape, key)
        for dim, o in kept.items():  # a kept dim's coordinates come out whole and in order
            co = np.broadcast_to(np.arange(shape[dim]).reshape((-1,) + (1,) * (len(shape) - dim - 1)),
                                 shape)[key]
            assert (np.moveaxis(co, o, -1) == np.arange(shape[dim])).all(), (shape, key, kept)
        checked += 1
    assert checked > 1200


def test_index_plan_errors_name_the_index_and_the_shape():
    with pytest.raises(DimError, match=r"index 5 is out of bounds for dimension 1 with size 5.*\(3, 5\)"):
        index_plan((3, 5), (slice(None), [0, 5]))
    with pytest.raises(DimError, match=r"mask \(2,\)"):
        index_plan((3, 5), np.ones(2, bool))
    with pytest.raises(DTypeError, match="float64"):
        index_plan((3, 5), np.zeros(2))


def test_index_digest_tells_indices_apart():
    """The digest that ranks compare before indexing (dtensor.dispatch.index_args): equal
    for indices built alike, different for any other value, length, dtype or nesting."""
    from placements.index_meta import index_digest

    same = [
        ([0, 5], [0, 5]),
        ((slice(None), np.array([6, 0])), (slice(None), np.array([6, 0]))),
        (np.array([True, False, True]), np.array([True, False, True])),
        ((Ellipsis, None, 2), (Ellipsis, None, 2)),
        (np.arange(6).reshape(2, 3)[:, ::2], np.array([[0, 2], [3, 5]])),  # layout aside
    ]
    for a, b in same:
        assert index_digest(a) == index_digest(b), a
    different = [
        [0, 5], [1, 6], [0, 5, 0], (0, 5), [[0, 5]], np.array([0, 5]),
        np.array([0, 5], np.int32), np.array([[0, 5]]), np.array([True, False]),
        (slice(None), [0, 5]), (slice(1, None), [0, 5]), 0, -5, slice(0, 5),
    ]
    digests = [index_digest(i)[0] for i in different]
    assert len(set(digests)) == len(digests)
    assert all(0 <= d < 2**63 for d in digests)
    assert [index_digest(i)[1] for i in ([0, 5], [[0, 1], [2, 3]], np.ones((2, 3)), 3)] == [
        2, 4, 6, 0]
    # a tensor index gives its values through as_array; an object without them, its repr
    box = type("Box", (), {"__repr__": lambda self: "Box()"})
    assert index_digest(box(), lambda v: np.array([0, 5]))[0] == index_digest(
        np.array([0, 5]))[0]
    assert index_digest(box())[0] != index_digest(np.array([0, 5]))[0]
