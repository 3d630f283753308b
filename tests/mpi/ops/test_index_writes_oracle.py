"""Writes through index arrays on sharded dims against numpy on the global data, at 1-4 ranks:
``x[idx] = v``, ``index_put`` (accumulating or not), ``index_add`` and ``scatter`` /
``scatter_add`` with negative, repeated and out-of-order index arrays.

The global array has 5 rows and 7 columns: uneven shards at 2-4 ranks and an empty shard
of the rows at 4. Every case writes into a fresh DTensor laid out Shard on either dim,
Replicate, Partial (random per-rank contributions) or, at 4 ranks, 2x2 layouts; the
expected value is numpy's write into a copy of the global array. Where an index repeats in
a non-accumulating write, the values written at that place are equal (so the result does
not depend on which write lands last).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.testing import distribute_random

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial
SHAPE = (5, 7)


def _layouts():
    """(mesh shape, placements) of the written tensor at this world size."""
    out = [((WORLD.size,), pl) for pl in ([S(0)], [S(1)], [R], [P("sum")])]
    if WORLD.size == 4:
        out += [((2, 2), pl) for pl in ([S(0), S(1)], [S(1), S(0)], [S(0), S(0)],
                                        [P("sum"), S(0)], [S(1), P("sum")])]
    return out


LAYOUTS = _layouts()
IDS = [f"{m}-{''.join(map(str, pl))}" for m, pl in LAYOUTS]


def _x(layout, seed):
    mesh_shape, pl = layout
    mesh = dt.init_device_mesh(mesh_shape)
    a = np.random.default_rng(seed).standard_normal(SHAPE)
    return mesh, a, distribute_random(a, mesh, pl, seed=seed + 1)


def _check(got, want, what):
    assert tuple(got.shape) == want.shape, what
    np.testing.assert_allclose(got.full_tensor().numpy(), want, rtol=1e-12, atol=1e-12,
                               err_msg=str(what))


def _set_cases(rng):
    """(key, value) pairs: index arrays with negative entries, repeats (written with equal
    values) and no order, on either dim, together and beside slices."""
    rows_t = rng.standard_normal(SHAPE)  # a value per global place: repeats write alike

    def by_place(r, c):
        return rows_t[np.asarray(r) % SHAPE[0], np.asarray(c) % SHAPE[1]]

    all_c, all_r = np.arange(SHAPE[1]), np.arange(SHAPE[0])
    neg_rows = np.array([-1, 3, -5, 0])
    rep_rows = np.array([4, -1, 2, 2, -3, 0])  # 4 and -1 are one row, 2 and -3 another
    neg_cols = np.array([-1, 0, -7, 5, -2, 3])  # -7 is 0
    pairs = (np.array([-1, 2, -5, 4, 0, -3]), np.array([6, -5, 0, -1, -7, 2]))
    return [
        (neg_rows, by_place(neg_rows[:, None], all_c)),
        (rep_rows, by_place(rep_rows[:, None], all_c)),
        ((slice(None), neg_cols), by_place(all_r[:, None], neg_cols)),
        ((slice(1, 5), neg_cols), by_place(np.arange(1, 5)[:, None], neg_cols)),
        ((neg_rows, slice(None, None, 2)), by_place(neg_rows[:, None], all_c[::2])),
        (pairs, by_place(*pairs)),
        ((np.array([[-1, 1], [3, -4]]), np.array([-2, 0])),
         by_place(np.array([[-1, 1], [3, -4]]), np.array([-2, 0]))),
        (rep_rows, 2.5),
        ((Ellipsis, neg_cols), 4.0),
        (-2, by_place(-2, all_c)),
        ((slice(None), -3), by_place(all_r, -3)),
        (([-1, 1, -1], [-7, 3, 0]), 7.0),
    ]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_setitem_with_negative_repeated_unordered_index_arrays(layout):
    for i, (key, value) in enumerate(_set_cases(np.random.default_rng(3))):
        for form in ("numpy", "tensor"):
            mesh, a, x = _x(layout, seed=i)
            k = key
            if form == "tensor":  # index arrays as local tensors
                k = tuple(dt.tensor(np.asarray(e)) if isinstance(e, (np.ndarray, list)) else e
                          for e in (key if isinstance(key, tuple) else (key,)))
            v = value if np.isscalar(value) else dt.distribute_tensor(
                np.asarray(value), mesh, [R] * mesh.ndim)
            x[k] = v
            want = a.copy()
            want[key] = value
            assert x.placements == tuple(layout[1]), (i, form)
            _check(x, want, (i, form, key))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_index_put_with_negative_and_repeated_indices(layout):
    rng = np.random.default_rng(5)
    rows = np.array([-1, 2, 4, -3, 0, -1, 2])
    cols = np.array([3, -7, -1, 5, 0, 3, -7])
    for acc in (True, False):
        mesh, a, x = _x(layout, seed=7)
        if acc:  # repeats add up
            vals = rng.standard_normal(rows.size)
        else:  # repeats write equal values
            vals = np.random.default_rng(6).standard_normal(SHAPE)[rows % 5, cols % 7]
        want = a.copy()
        if acc:
            np.add.at(want, (rows, cols), vals)
        else:
            want[rows, cols] = vals
        vd = dt.distribute_tensor(vals, mesh, [R] * mesh.ndim)
        _check(x.index_put((dt.tensor(rows), dt.tensor(cols)), vd, acc), want, ("put", acc))
        x.index_put_((dt.tensor(rows),), dt.distribute_tensor(
            np.ones((rows.size, 1)), mesh, [R] * mesh.ndim), accumulate=True)
        want_in_place = a.copy()
        np.add.at(want_in_place, (rows,), np.ones((rows.size, 1)))
        assert x.placements == tuple(layout[1])
        _check(x, want_in_place, ("put_", acc))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_index_add_and_scatter_with_repeated_unordered_indices(layout):
    rng = np.random.default_rng(8)
    for dim in (0, 1):
        n = SHAPE[dim]
        idx = np.array([n - 1, 0, n - 1, 2, 1, 2, n - 1])  # repeats, no order
        mesh, a, x = _x(layout, seed=9 + dim)
        src_shape = (idx.size, SHAPE[1]) if dim == 0 else (SHAPE[0], idx.size)
        src = rng.standard_normal(src_shape)
        want = a.copy()
        np.add.at(want, (slice(None),) * dim + (idx,), -1.5 * src)
        sd = dt.distribute_tensor(src, mesh, [R] * mesh.ndim)
        _check(dt.index_add(x, dim, dt.tensor(idx), sd, alpha=-1.5), want, ("index_add", dim))
        # scatter_add: a full index of repeats; scatter: a permutation (no two writes meet)
        index = rng.integers(0, n, SHAPE)
        vals = rng.standard_normal(SHAPE)
        want = a.copy()
        grid = list(np.indices(SHAPE))
        grid[dim] = index
        np.add.at(want, tuple(grid), vals)
        vd = dt.distribute_tensor(vals, mesh, [R] * mesh.ndim)
        _check(x.scatter_add(dim, dt.tensor(index), vd), want, ("scatter_add", dim))
        perm = np.stack([rng.permutation(n) for _ in range(SHAPE[1 - dim])], axis=1 - dim)
        want = a.copy()
        grid[dim] = perm
        want[tuple(grid)] = vals
        _check(x.scatter(dim, dt.tensor(perm), vd), want, ("scatter", dim))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("extra", [3, -2])
def test_scatter_with_an_index_longer_or_shorter_than_the_input_along_its_dim(layout, extra):
    """The index (and src) has ``SHAPE[dim] + extra`` entries along ``dim`` and the input's
    size on the other dim, which may stay sharded: each rank's index must keep every entry
    along ``dim`` (a cut to the output's block there dropped the entries past the input's
    size: wrong sums of scatter_add, and of index_select's gradient)."""
    rng = np.random.default_rng(21 + extra)
    for dim in (0, 1):
        n = SHAPE[dim]
        ishape = list(SHAPE)
        ishape[dim] = n + extra
        index = rng.integers(-n, n, ishape)  # repeats and negative entries
        vals = rng.standard_normal(ishape)
        mesh, a, x = _x(layout, seed=31 + dim)
        grid = list(np.indices(ishape))
        grid[dim] = index % n
        want = a.copy()
        np.add.at(want, tuple(grid), vals)
        vd = dt.distribute_tensor(vals, mesh, [R] * mesh.ndim)
        _check(x.scatter_add(dim, dt.tensor(index % n), vd), want, ("scatter_add", dim, extra))
        other = 1 - dim
        sharded_src = [S(other) if p.is_shard() else R for p in layout[1]]
        vs = dt.distribute_tensor(vals, mesh, sharded_src)
        _check(x.scatter_add(dim, dt.tensor(index % n), vs), want,
               ("scatter_add, src sharded", dim, extra))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=IDS[:3])
def test_index_select_gradient_with_more_indices_than_rows(layout):
    """index_select along dim 0 of 7 repeated indices into 5 rows: the gradient is the
    upstream rows added at their indices (numpy's add.at), on every layout of the input."""
    mesh, a, _ = _x(layout, seed=41)
    idx = np.array([4, 0, 4, 2, 1, 2, 4])
    up = np.random.default_rng(42).standard_normal((idx.size, SHAPE[1]))
    want = np.zeros(SHAPE)
    np.add.at(want, idx, up)
    x = dt.distribute_tensor(a, mesh, list(layout[1])).requires_grad_()
    out = dt.index_select(x, 0, dt.tensor(idx))
    (g,) = dt.autograd.grad((out * dt.distribute_tensor(up, mesh, [R] * mesh.ndim)).sum(), [x])
    np.testing.assert_allclose(g.full_tensor().numpy(), want, rtol=1e-12, atol=1e-12)
