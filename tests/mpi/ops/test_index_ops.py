"""Indexing ops on DTensors against numpy on the global data, at 1-4 ranks: uneven and
empty shards (5 rows over 2-4 ranks), Shard/Replicate/Partial inputs, and typed errors
raised on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import CommError, DimError, DTypeError, ShardingError
from dtensor.testing import distribute_random

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial
SHAPE = (5, 7)


def _mesh():
    return dt.init_device_mesh((WORLD.size,))


def _layouts():
    return ([S(0)], [S(1)], [R], [P("sum")], [P("max")])


def _x(mesh, pl, seed=0):
    a = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    return a, distribute_random(a, mesh, pl, seed=seed + 1)


def _idx(mesh, arr, pl=(R,)):
    return dt.distribute_tensor(arr, mesh, list(pl))


def _only_index_checks(mode, n):
    """No data moved: only ``n`` index checks (an all-gather of a digest each, which the
    ranks compare before indexing a sharded DTensor with an index array) when ranks > 1."""
    assert mode.get_comm_counts() == ({"all_gather_ints": n} if WORLD.size > 1 else {}), (
        mode.get_comm_counts())


def _check(got, want):
    assert tuple(got.shape) == np.shape(want)
    np.testing.assert_allclose(got.full_tensor().numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi(min_size=1)
def test_selections_match_numpy():
    mesh = _mesh()
    rng = np.random.default_rng(5)
    for pl in _layouts():
        a, x = _x(mesh, pl)
        for dim in (0, 1):
            n = SHAPE[dim]
            sel = rng.integers(0, n, (6,))
            _check(dt.index_select(x, dim, _idx(mesh, sel, [S(0)])), np.take(a, sel, axis=dim))
            g = rng.integers(0, n, SHAPE)
            _check(x.gather(dim, _idx(mesh, g)), np.take_along_axis(a, g, axis=dim))
            t = rng.integers(0, n, (1, 3) if dim == 1 else (3, 1))
            _check(dt.take_along_dim(x, _idx(mesh, t), dim), np.take_along_axis(a, t, dim))
        m = rng.random(SHAPE) < 0.4
        _check(x.masked_fill(_idx(mesh, m, pl[:1] if pl[0].is_shard() else [R]), -2.0),
               np.where(m, np.float32(-2.0), a))
        _check(dt.where(_idx(mesh, m), x, 0.0), np.where(m, a, 0))


@pytest.mark.mpi(min_size=1)
def test_scatters_match_numpy():
    mesh = _mesh()
    rng = np.random.default_rng(6)
    for pl in _layouts():
        a, x = _x(mesh, pl)
        src = rng.standard_normal(SHAPE).astype(np.float32)
        s = distribute_random(src, mesh, pl, seed=9)
        for dim in (0, 1):
            index = np.argsort(rng.random(SHAPE), axis=dim)  # distinct targets per line
            want = a.copy()
            np.put_along_axis(want, index, src, axis=dim)
            _check(dt.scatter(x, dim, _idx(mesh, index), s), want)
            if pl[0] != P("max"):
                dup = rng.integers(0, SHAPE[dim], SHAPE)
                want = a.copy()
                grid = list(np.indices(SHAPE))
                grid[dim] = dup
                np.add.at(want, tuple(grid), src)
                _check(x.scatter_add(dim, _idx(mesh, dup), s), want)
        y = x.redistribute(mesh, [S(1)]) if not pl[0].is_partial() else x
        before = y.full_tensor().numpy()
        index = np.argsort(rng.random((2, 7)), axis=0)
        y.scatter_(0, _idx(mesh, index), 4.0)
        want = before.copy()
        np.put_along_axis(want, index, np.float32(4.0), axis=0)
        _check(y, want)


@pytest.mark.mpi(min_size=1)
def test_sorts_match_numpy():
    mesh = _mesh()
    rng = np.random.default_rng(7)
    a = rng.integers(0, 4, SHAPE).astype(np.float32)  # ties: stable order
    for pl in ([S(0)], [S(1)], [R]):
        x = dt.distribute_tensor(a, mesh, pl)
        for dim in (0, 1):
            v, i = x.sort(dim)
            order = np.argsort(a, axis=dim, kind="stable")
            _check(v, np.take_along_axis(a, order, dim))
            _check(i, order)
            _check(dt.argsort(x, dim, descending=True),
                   np.flip(a.shape[dim] - 1 - np.argsort(np.flip(a, dim), dim, kind="stable"),
                           dim))
            top, where = x.topk(2, dim)
            _check(top, -np.sort(-a, axis=dim, kind="stable").take(range(2), axis=dim))
            np.testing.assert_array_equal(
                np.take_along_axis(a, where.full_tensor().numpy(), dim), top.full_tensor().numpy()
            )
            kv, _ = x.kthvalue(2, dim)
            _check(kv, np.sort(a, axis=dim).take(1, axis=dim))


@pytest.mark.mpi(min_size=1)
def test_local_along_unsharded_dims():
    mesh = _mesh()
    _, x = _x(mesh, [S(0)])
    idx = _idx(mesh, np.array([6, 0, 3]))
    g = _idx(mesh, np.zeros(SHAPE, np.int64))
    with dt.debug.CommDebugMode() as mode:
        y = dt.index_select(x, 1, idx)
        z = x.gather(1, g)
        v, _ = x.sort(1)
        w = x.masked_fill(x > 0, 0.0)
    assert mode.get_total_counts() == 0
    assert y.placements == z.placements == v.placements == w.placements == (S(0),)


@pytest.mark.mpi(min_size=1)
def test_bad_indices_raise_on_every_rank():
    mesh = _mesh()
    _, x = _x(mesh, [S(0)])
    cases = [
        (lambda: x.gather(0, _idx(mesh, np.full(SHAPE, 5))), DimError,
         "gather: index 5 is out of bounds for dimension 0 with size 5"),
        (lambda: dt.index_select(x, 1, _idx(mesh, np.array([-1]))), DimError,
         "index -1 is out of bounds for dimension 1 with size 7"),
        (lambda: dt.index_select(x, 0, _idx(mesh, np.array([0.5]))), DTypeError, "float64"),
        (lambda: x.masked_fill(_idx(mesh, np.ones((2, 7), bool)), 0.0), ShardingError,
         "masked_fill"),
        (lambda: x.masked_fill(_idx(mesh, np.ones(SHAPE)), 0.0), DTypeError, "boolean"),
        (lambda: x.scatter(0, _idx(mesh, np.zeros(SHAPE, np.int64)), _idx(mesh, np.ones((2, 7),
                                                                                      np.float32))),
         ShardingError, "scatter"),
        (lambda: x.topk(8, 1), DimError, "topk"),
    ]
    for fn, kind, text in cases:
        with pytest.raises(kind, match=text.replace("(", r"\(").replace(")", r"\)")):
            fn()


def _keys(rng):
    mask0 = rng.random(SHAPE[0]) < 0.5
    return [
        np.array([4, 0, 2]),
        [1, 1, 3],
        dt.tensor([0, 2]),
        (slice(None), [6, 0, 3]),
        (slice(None), dt.tensor(np.array([5, 1]))),
        mask0,
        (slice(None), rng.random(SHAPE[1]) < 0.5),
        rng.random(SHAPE) < 0.3,
        (np.array([[0, 1], [4, 4]]), np.array([6, 0])),
        (np.array([0, 3]), slice(1, None)),
        (Ellipsis, [2]),
        ([0, 2], None),
    ]


def _np_key(key):
    if isinstance(key, tuple):
        return tuple(_np_key(k) for k in key)
    return key.numpy() if isinstance(key, dt.Tensor) else key


@pytest.mark.mpi(min_size=1)
def test_advanced_getitem_matches_numpy():
    mesh = _mesh()
    for pl in _layouts():
        a, x = _x(mesh, pl)
        for key in _keys(np.random.default_rng(3)):
            y = x[key]
            want = a[_np_key(key)]
            assert y.shape == want.shape, key
            _check(y, want)
            if pl[0].is_partial():
                assert y.placements == tuple(pl)


@pytest.mark.mpi(min_size=1)
def test_list_and_tuple_indices_are_cached_apart():
    mesh = _mesh()
    a, x = _x(mesh, [S(1)])
    for _ in range(3):  # hits of the propagation cache and the compiled front alike
        _check(x[0, 2], a[0, 2])
        _check(x[[0, 2]], a[[0, 2]])
        _check(x[[0, 2], 1], a[[0, 2], 1])


@pytest.mark.mpi(min_size=1)
def test_bad_advanced_indices_raise_on_every_rank():
    mesh = _mesh()
    _, x = _x(mesh, [S(0)])
    with pytest.raises(DimError, match=r"index 5 is out of bounds for dimension 0 with size 5"):
        x[[0, 5]]
    with pytest.raises(DimError, match=r"global shape \(5, 7\)"):
        x[:, np.array([-8])]
    with pytest.raises(DTypeError, match="float32"):
        x[np.array([1.0], np.float32)]
    with pytest.raises(DimError, match=r"shape of the mask \(4,\)"):
        x[np.ones(4, bool)]


def _set_cases(rng):
    r, c = SHAPE
    return [
        (slice(1, None, 2), 0.5),
        ((slice(None), 2), rng.standard_normal(r).astype(np.float32)),
        ((slice(1, 4), slice(None)), rng.standard_normal(c).astype(np.float32)),
        ((slice(None), slice(0, c, 3)), rng.standard_normal((r, 3)).astype(np.float32)),
        (3, -1.0),
        (-1, rng.standard_normal(c).astype(np.float32)),
        (rng.random(SHAPE) < 0.4, 7.0),
        ([0, 4], rng.standard_normal((2, c)).astype(np.float32)),
        ((slice(None), np.array([6, 0])), 2.0),
        (np.array([4, 1]), 3.0),
        ((Ellipsis, [1, 2]), rng.standard_normal((r, 2)).astype(np.float32)),
        (np.arange(r * c).reshape(SHAPE) % 3 == 0, np.arange(12, dtype=np.float32)),
        (np.array([[4, 0], [2, 2]]), rng.standard_normal((2, 2, c)).astype(np.float32)),
        # several index arrays, on the sharded dim too
        (([0, 4, 2, 4], [6, 0, 3, 6]), rng.standard_normal(4).astype(np.float32)),
        ((np.array([[4], [1]]), np.array([1, 6])), 3.0),
        ((np.array([3, 0]), slice(1, 5, 2), np.array([0, 5]))[::2], -4.0),
    ]


@pytest.mark.mpi(min_size=1)
def test_setitem_writes_each_ranks_part():
    mesh = _mesh()
    for pl in _layouts():
        for key, value in _set_cases(np.random.default_rng(4)):
            a, x = _x(mesh, pl)
            v = value if isinstance(value, float) else _idx(mesh, value)
            x[key] = v
            want = a.copy()
            want[key] = value
            assert x.placements == tuple(pl)
            _check(x, want)
    # a scalar written into shards, and a value laid out like the kept dims: no data moves
    # (with more than one rank, the two index arrays are checked: one digest exchange each)
    a, x = _x(mesh, [S(0)])
    v = dt.distribute_tensor(np.ones((5, 2), np.float32), mesh, [S(0)])
    with dt.debug.CommDebugMode() as mode:
        x[1:4] = 0.0
        x[np.array([0, 4])] = 1.0
        x[:, 5:] = v
        x[[0, 3], [1, 2]] = 2.0
    _only_index_checks(mode, 2)
    want = a.copy()
    want[1:4] = 0
    want[[0, 4]] = 1
    want[:, 5:] = 1
    want[[0, 3], [1, 2]] = 2
    _check(x, want)


@pytest.mark.mpi(min_size=1)
def test_setitem_errors_on_every_rank():
    mesh = _mesh()
    _, x = _x(mesh, [S(0)])
    with pytest.raises(ShardingError, match=r"shape mismatch: value tensor of shape \(3,\)"):
        x[:, 1:3] = _idx(mesh, np.ones(3, np.float32))
    with pytest.raises(DimError, match="index 9 is out of bounds for dimension 1 with size 7"):
        x[:, [9]] = 0.0
    with pytest.raises(DimError, match=r"shape of the mask \(5, 6\)"):
        x[np.ones((5, 6), bool)] = 0.0
    with pytest.raises(DTypeError, match="float64"):
        x[np.array([0.0])] = 1.0


@pytest.mark.mpi(min_size=1)
def test_nonzero_and_masked_select_gather_to_replicate():
    mesh = _mesh()
    rng = np.random.default_rng(8)
    a = (rng.random(SHAPE) < 0.3) * rng.standard_normal(SHAPE).astype(np.float32)
    m = rng.random(SHAPE) < 0.5
    for pl in ([S(0)], [S(1)], [R], [P("max")]):  # (a P(sum)'s zeros may round)
        x = distribute_random(a, mesh, pl, seed=2)
        nz = x.nonzero()
        assert nz.placements == (R,) and nz.dtype == np.int64
        np.testing.assert_array_equal(nz.to_local().numpy(), np.argwhere(a))
        rows, cols = dt.nonzero(x, as_tuple=True)
        np.testing.assert_array_equal(rows.to_local().numpy(), np.nonzero(a)[0])
        np.testing.assert_array_equal(cols.to_local().numpy(), np.nonzero(a)[1])
        for mask in (_idx(mesh, m, [S(0)]), dt.tensor(m[0])):
            sel = dt.masked_select(x, mask)
            want = np.broadcast_to(a, SHAPE)[np.broadcast_to(mask.full_tensor().numpy()
                                                             if isinstance(mask, dt.DTensor)
                                                             else mask.numpy(), SHAPE)]
            assert sel.placements == (R,)
            np.testing.assert_allclose(sel.to_local().numpy(), want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(dt.nonzero(dt.tensor(a)).numpy(), np.argwhere(a))


@pytest.mark.mpi(min_size=1)
def test_index_add_and_index_put_match_numpy():
    mesh = _mesh()
    rng = np.random.default_rng(10)
    for pl in _layouts():
        a, x = _x(mesh, pl)
        for dim in (0, 1):
            idx = rng.integers(0, SHAPE[dim], (6,))  # duplicates accumulate
            src_np = rng.standard_normal((6, 7) if dim == 0 else (5, 6)).astype(np.float32)
            src = distribute_random(src_np, mesh, pl if pl[0] != P("max") else [R], seed=3)
            want = a.copy()
            np.add.at(want, (slice(None),) * dim + (idx,), 2 * src_np)
            if pl[0] != P("max"):
                _check(dt.index_add(x, dim, _idx(mesh, idx), src, alpha=2), want)
        rows, cols = rng.integers(0, 5, (4,)), rng.integers(0, 7, (4,))
        vals = rng.standard_normal(4).astype(np.float32)
        for acc in (False, True):
            want = a.copy()
            if acc:
                np.add.at(want, (rows, cols), vals)
            else:
                want[rows, cols] = vals
            _check(x.index_put((dt.tensor(rows), dt.tensor(cols)), _idx(mesh, vals), acc), want)
        # in place keeps the placements
        y = distribute_random(a, mesh, pl, seed=4)
        y.index_put_((None, dt.tensor([6, 0])), _idx(mesh, np.ones((5, 1), np.float32)),
                     accumulate=True)
        want = a.copy()
        want[:, [6, 0]] += 1
        assert y.placements == tuple(pl)
        _check(y, want)
        if not pl[0].is_partial():
            y.index_add_(0, _idx(mesh, np.array([4, 4])), _idx(mesh, np.ones((2, 7), np.float32)))
            want[4] += 2
            assert y.placements == tuple(pl)
            _check(y, want)
    # the indexed dims sharded, source and value replicated: each shard writes its block's
    # entries, no data moves (with more than one rank, index_put's indices are checked)
    a, x = _x(mesh, [S(0)])
    idx, src = _idx(mesh, np.array([4, 0, 4])), _idx(mesh, np.ones((3, 7), np.float32))
    with dt.debug.CommDebugMode() as mode:
        y = dt.index_add(x, 0, idx, src)
        x.index_put_((dt.tensor([1, 3, 1]), dt.tensor([0, 6, 0])), 5.0, accumulate=True)
    _only_index_checks(mode, 1)
    assert y.placements == x.placements == (S(0),)
    want = a.copy()
    want[[0, 4]] += [[1], [2]]
    _check(y, want)
    want = a.copy()
    want[1, 0] += 10
    want[3, 6] += 5
    _check(x, want)


@pytest.mark.mpi(min_size=1)
def test_index_add_and_index_put_errors_on_every_rank():
    mesh = _mesh()
    _, x = _x(mesh, [S(0)])
    src = _idx(mesh, np.ones((2, 7), np.float32))
    cases = [
        (lambda: dt.index_add(x, 0, _idx(mesh, np.array([0, 5])), src), DimError,
         "index_add: index 5 is out of bounds for dimension 0 with size 5"),
        (lambda: dt.index_add(x, 0, _idx(mesh, np.array([0.0, 1.0])), src), DTypeError,
         "float64"),
        (lambda: dt.index_add(x, 1, _idx(mesh, np.array([0, 1])), src), ShardingError,
         "source of shape (2, 7)"),
        (lambda: x.index_put((dt.tensor([7]),), 0.0), DimError,
         "index 7 is out of bounds for dimension 0 with size 5"),
        (lambda: x.index_put((None, dt.tensor([1.5])), 0.0), DTypeError, "float32"),
        (lambda: x.index_put((dt.tensor([0, 1]),), _idx(mesh, np.ones(3, np.float32))),
         ShardingError, "index_put: shape mismatch: value tensor of shape (3,)"),
        (lambda: x.index_put((dt.tensor([0]),), _idx(mesh, np.ones(7))), DTypeError,
         "dtypes match"),
    ]
    for fn, kind, text in cases:
        with pytest.raises(kind, match=text.replace("(", r"\(").replace(")", r"\)")):
            fn()


@pytest.mark.mpi(min_size=1)
def test_getitem_on_a_sharded_dim_chosen_by_cost():
    """A few rows of a tall row-sharded tensor: each rank picks its rows and masks the others
    (a P(sum) result, nothing moved); many rows out of a small one: the indexed dim is
    gathered rather than a large result reduced."""
    mesh = _mesh()
    tall = np.random.default_rng(11).standard_normal((256, 16)).astype(np.float32)
    x = dt.distribute_tensor(tall, mesh, [S(0)])
    for key in ([3, 140, -1], (np.array([250, 0]), slice(None, None, 2)),
                np.arange(256) % 97 == 0):
        with dt.debug.CommDebugMode() as mode:
            y = x[key]
        _only_index_checks(mode, 1)
        if WORLD.size > 1:
            assert y.placements == (P("sum"),), key
        _check(y, tall[key])
    small = tall[:8, :4].copy()  # 32 elements
    x = dt.distribute_tensor(small, mesh, [S(0)])
    many = np.random.default_rng(12).integers(0, 8, (512,))
    with dt.debug.CommDebugMode() as mode:
        y = x[many]
    assert y.placements != (P("sum"),)
    if WORLD.size > 1:
        assert mode.get_total_counts() > 0
    _check(y, small[many])


def _multi_keys():
    rows, cols = np.array([[299], [0], [150]]), np.array([5, 0, -1, 2])
    return [
        (rows, cols),  # broadcast to (3, 4)
        (np.array([7, 299, 7]), 4),  # an int among the arrays
        (np.array([3, 200]), np.array([False, True, False, False, True, False])),
        (Ellipsis, np.array([1, 298]), np.array([[2], [5]])),
    ]


@pytest.mark.mpi(min_size=1)
def test_getitem_with_several_index_arrays_on_sharded_dims():
    """x[rows, cols] (arrays, a mask, an int among them) with the indexed dims sharded on a
    1-D mesh and a 2x2 one (6 columns over 4 ranks: an empty shard): few entries of a tall
    tensor are picked and masked on each rank (no all_gather, a P(sum) result); many
    entries of a small tensor gather the indexed dims instead."""
    tall = np.random.default_rng(13).standard_normal((300, 6)).astype(np.float32)
    layouts = [(_mesh(), [S(0)]), (_mesh(), [S(1)])]
    if WORLD.size == 4:
        mesh2 = dt.init_device_mesh((2, 2))
        layouts += [(mesh2, [S(0), S(1)]), (mesh2, [S(1), S(0)]), (mesh2, [S(0), S(0)])]
    for mesh, pl in layouts:
        x = dt.distribute_tensor(tall, mesh, pl)
        for key in _multi_keys():
            with dt.debug.CommDebugMode() as mode:
                y = x[key]
            _only_index_checks(mode, 1)
            if WORLD.size > 1:
                assert P("sum") in y.placements, (pl, key)
            _check(y, tall[key])
    small = tall[:4, :4].copy()
    x = dt.distribute_tensor(small, _mesh(), [S(1)])
    rng = np.random.default_rng(14)
    key = (rng.integers(0, 4, (64, 1)), rng.integers(0, 4, (1, 32)))
    with dt.debug.CommDebugMode() as mode:
        y = x[key]
    assert y.placements != (P("sum"),)
    if WORLD.size > 1:
        assert mode.get_comm_counts().get("all_gather", 0) > 0
    _check(y, small[key])


def _per_rank(*choices):
    """This rank's pick of ``choices`` (rank 0 the first, the others the second)."""
    return choices[0] if WORLD.rank == 0 else choices[1]


def _divergent_calls(mesh, x):
    """Index calls whose index differs between rank 0 and the others, one per case."""
    rows = SHAPE[0]
    same_len = _per_rank([0, 3], [1, 4])
    mask = np.zeros(rows, bool)
    mask[_per_rank([0, 1], [2, 3])] = True
    longer = _per_rank([0, 1], [0, 1, 2])
    values = dt.distribute_tensor(np.ones(2, np.float32), mesh, [R])

    def put():
        x.index_put_((dt.tensor(np.array(same_len)),), values)

    return {
        "read, same length": lambda: x[same_len],
        "read, other lengths": lambda: x[longer],
        "read, mask": lambda: x[mask],
        "read, tensor index": lambda: x[:, dt.tensor(np.array(_per_rank([0, 6], [6, 0])))],
        "read, two arrays": lambda: x[same_len, [1, 2]],
        "write, same length": lambda: x.__setitem__(same_len, 5.0),
        "write, other lengths": lambda: x.__setitem__(longer, 5.0),
        "write, mask": lambda: x.__setitem__(mask, 5.0),
        "index_put_": put,
    }


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pl", [[S(0)], [S(1)], [P("sum")]], ids=str)
def test_rank_divergent_index_raises_on_every_rank(pl):
    """Each rank passing its own index gave rows that were no rank's answer (S(0) read),
    replicas that differ after a write, or a hang (different lengths): every rank raises
    CommError instead, before any data moves, and the next ops run as usual."""
    mesh = _mesh()
    a, x = _x(mesh, pl)
    for name, call in _divergent_calls(mesh, x).items():
        for _ in range(3):  # also once the compiled front has seen the call
            with pytest.raises(CommError, match="passed different index arguments") as err:
                call()
            assert "Every rank raises" in str(err.value), name
        _check(x, a)  # nothing was written, and the ranks are still in step
    # the same index on every rank: served as before, repeatedly (front hits included)
    for _ in range(3):
        _check(x[[0, 3]], a[[0, 3]])
        _check(x[:, np.array([6, 0])], a[:, [6, 0]])


@pytest.mark.mpi(min_size=2)
def test_rank_divergent_index_on_a_replicated_input_raises_under_check_spmd():
    """On a replicated input the op is purely local: the index is compared only while the
    SPMD check is on (where every index counts, ints and slices too)."""
    mesh = _mesh()
    a, x = _x(mesh, [R])
    with dt.debug.CommDebugMode() as mode:
        y = x[[0, 3]]
        x[[1]] = 2.0
    assert mode.get_total_counts() == 0 and y.placements == (R,)
    a[[1]] = 2.0
    _check(x, a)
    with dt.debug.check_spmd():
        for call in (*_divergent_calls(mesh, x).values(), lambda: x[_per_rank(0, 1)],
                     lambda: x.__setitem__((slice(None), _per_rank(2, 3)), 1.0)):
            with pytest.raises(CommError, match="passed different index arguments"):
                call()
        _check(x[[0, 3]], a[[0, 3]])
    _check(x, a)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pl", [[S(0)], [S(1)], [R], [P("sum")]], ids=str)
def test_dtensor_masks_and_indices(pl):
    """x[x > 0] = 0, the commonest idiom, raised a numpy-conversion DTypeError: a mask laid
    out like x writes locally (masked_fill_); a read gathers the mask (as nonzero does); a
    DTensor integer index is gathered too."""
    mesh = _mesh()
    a, x = _x(mesh, pl)
    want = a.copy()
    want[want > 0] = 0
    with dt.debug.CommDebugMode() as mode:
        m = x > 0
        moved = mode.get_total_counts()  # a Partial x is reduced for the comparison
        x[m] = 0
    if not pl[0].is_partial():
        assert mode.get_total_counts() == moved == 0, mode.get_comm_counts()
    assert x.placements == tuple(pl)
    _check(x, want)
    a, x = _x(mesh, pl)
    _check(x[x < 0], a[a < 0])
    _check(x[x < 0].sum(), a[a < 0].sum())
    rows = a[:, 0] > 0
    for layout in ([R], [S(0)]):
        r = _idx(mesh, rows, layout)
        _check(x[r], a[rows])
        y = distribute_random(a, mesh, pl, seed=1)
        y[r] = -3.0  # a mask over the leading dims: still masked_fill_
        w = a.copy()
        w[rows] = -3.0
        _check(y, w)
        y[r] = _idx(mesh, np.arange(7 * rows.sum(), dtype=np.float32).reshape(-1, 7))
        w[rows] = np.arange(7 * rows.sum()).reshape(-1, 7)
        _check(y, w)
    i = _idx(mesh, np.array([4, 0, 4]))
    _check(x[i], a[[4, 0, 4]])
    _check(x[:, _idx(mesh, np.array([6, 1]))], a[:, [6, 1]])
    # the gradient through a DTensor mask
    g = distribute_random(a, mesh, [S(0)], seed=5).requires_grad_()
    (g[g > 0] * 2.0).sum().backward()
    np.testing.assert_allclose(g.grad.full_tensor().numpy(), 2.0 * (a > 0))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pl", [[S(0)], [S(1)], [R]], ids=str)
def test_index_ops_take_a_local_index(pl):
    """index_select / gather / take_along_dim / scatter(_add) / index_add with a local
    tensor index (replicated, as x[idx] takes it) raised "cannot mix"."""
    mesh = _mesh()
    a, x = _x(mesh, pl)
    rng = np.random.default_rng(21)
    for dim in (0, 1):
        n = SHAPE[dim]
        sel = rng.integers(0, n, (4,))
        _check(dt.index_select(x, dim, dt.tensor(sel)), np.take(a, sel, axis=dim))
        _check(x.index_select(dim, sel), np.take(a, sel, axis=dim))  # an ndarray too
        g = rng.integers(0, n, SHAPE)
        _check(x.gather(dim, dt.tensor(g)), np.take_along_axis(a, g, axis=dim))
        _check(dt.take_along_dim(x, dt.tensor(g), dim), np.take_along_axis(a, g, axis=dim))
        perm = np.argsort(rng.random(SHAPE), axis=dim)
        src = rng.standard_normal(SHAPE).astype(np.float32)
        want = a.copy()
        np.put_along_axis(want, perm, src, axis=dim)
        _check(x.scatter(dim, dt.tensor(perm), _idx(mesh, src, pl)), want)
        want = a.copy()
        np.add.at(want, (slice(None),) * dim + (sel,),
                  np.take(src, range(4), axis=dim))
        source = _idx(mesh, np.ascontiguousarray(np.take(src, range(4), axis=dim)))
        _check(dt.index_add(x, dim, dt.tensor(sel), source), want)
    if WORLD.size > 1 and pl[0].is_shard():  # a local index is checked like x[idx]
        with pytest.raises(CommError, match="passed different index arguments"):
            dt.index_select(x, 0, dt.tensor(np.array([WORLD.rank % 2, 2])))
