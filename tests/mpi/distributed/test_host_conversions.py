"""Python and numpy protocols of DTensor under SPMD: the collective conversions (``item``,
``bool``, ``float``, ``int``, ``tolist``, ``in``) give every rank the global value; the
refused ones (numpy conversion, numpy functions and ufuncs, pickling, iteration over a
sharded dim, ``bool`` of several elements) raise typed errors without communicating;
metadata queries and ``repr`` never communicate."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from helpers.mpi import meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import DTypeError, ValueConversionError

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial


def layouts(mesh, ndim):
    opts = [R, P("sum"), P("max")] + [S(d) for d in range(ndim)]
    if mesh.ndim == 1:
        return [(p,) for p in opts]
    return [(a, b) for a in opts for b in opts][::3]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(1,), (1, 1), ()])
def test_scalar_conversions_agree_on_every_rank(shape):
    value = np.full(shape, 2.75, np.float64)
    for mesh in meshes():
        for pl in layouts(mesh, len(shape)):
            x = dt.distribute_tensor(value, mesh, pl)
            assert x.item() == 2.75
            assert float(x) == 2.75 and int(x) == 2 and complex(x) == 2.75
            assert bool(x) is True
            assert bool(x - 2.75) is False
            assert x.tolist() == value.tolist()
            assert WORLD.allgather(x.item()) == [2.75] * WORLD.size


@pytest.mark.mpi(min_size=1)
def test_tolist_and_contains_of_uneven_shards():
    arr = np.arange(15, dtype=np.int64).reshape(5, 3)
    for mesh in meshes():
        for pl in layouts(mesh, 2):
            x = dt.distribute_tensor(arr, mesh, pl)
            assert x.tolist() == arr.tolist()
            assert 7 in x and 99 not in x


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(3, 2), (0,), (2,)])
def test_several_elements_raise_without_communicating(shape):
    for mesh in meshes():
        x = dt.distribute_tensor(np.ones(shape, np.float32), mesh, [S(0)] * mesh.ndim)
        n = int(np.prod(shape))
        with dt.debug.CommDebugMode() as mode:
            with pytest.raises(ValueConversionError, match=f"Tensor with {n} values is ambiguous"):
                bool(x)
            for conv in (lambda t: t.item(), float, int):
                with pytest.raises(ValueConversionError, match=f"with {n} elements cannot"):
                    conv(x)
        assert mode.get_total_counts() == 0


def _refused():
    """The numpy/pickle hazards, each a function of a DTensor that must raise DTypeError."""
    return {
        "asarray": np.asarray,
        "array": np.array,
        "exp": np.exp,
        "sum": np.sum,
        "concatenate": lambda x: np.concatenate([x, x]),
        "add.reduce": np.add.reduce,
        "add out": lambda x: np.add(x, 1, out=np.empty(x.shape)),
        "testing": lambda x: np.testing.assert_allclose(x, 0),
        "pickle": pickle.dumps,
    }


@pytest.mark.mpi(min_size=1)
def test_numpy_and_pickle_raise_typed_errors_without_communicating():
    for mesh in meshes():
        x = dt.distribute_tensor(np.arange(12.0).reshape(4, 3), mesh, [S(0)] * mesh.ndim)
        with dt.debug.CommDebugMode() as mode:
            for name, fn in _refused().items():
                with pytest.raises(DTypeError) as info:
                    fn(x)
                text = str(info.value)
                if name != "pickle":
                    assert "full_tensor()" in text and "to_local()" in text, name
                else:
                    assert "to_local()" in text and "from_local" in text
        assert mode.get_total_counts() == 0


@pytest.mark.mpi(min_size=1)
def test_ndarray_operators_still_defer_to_dtensor():
    mesh = dt.init_device_mesh((WORLD.size,))
    arr = np.arange(6.0).reshape(3, 2)
    x = dt.distribute_tensor(arr, mesh, [S(0)])
    np.testing.assert_array_equal((np.float64(2) * x).full_tensor().numpy(), 2 * arr)
    np.testing.assert_array_equal((np.array(1.0) + x).full_tensor().numpy(), arr + 1)
    np.testing.assert_array_equal((np.array(2.0) < x).full_tensor().numpy(), arr > 2)
    np.testing.assert_array_equal(np.subtract(np.array(1.0), x).full_tensor().numpy(), 1 - arr)


@pytest.mark.mpi(min_size=1)
def test_metadata_repr_iteration_and_copies_are_local():
    arr = np.arange(10.0).reshape(5, 2)
    for mesh in meshes():
        x = dt.distribute_tensor(arr, mesh, [S(1)] + [R] * (mesh.ndim - 1))
        with dt.debug.CommDebugMode() as mode:
            text = repr(x) + str(x)
            assert "DTensor" in text and len(x) == 5 and x.shape == (5, 2)
            assert x.size(0) == 5 and x.numel() == 10 and x.ndim == 2
            rows = list(x)
            shallow, deep = copy.copy(x), copy.deepcopy(x)
        assert mode.get_total_counts() == 0
        assert len(rows) == 5 and all(r.placements[0] == S(0) and r.shape == (2,) for r in rows)
        for i, r in enumerate(rows):
            np.testing.assert_array_equal(r.full_tensor().numpy(), arr[i])
        assert shallow.to_local() is x.to_local()
        assert deep.to_local() is not x.to_local() and deep.placements == x.placements
        np.testing.assert_array_equal(deep.full_tensor().numpy(), arr)
        y = dt.distribute_tensor(arr, mesh, [S(0)] * mesh.ndim)
        with pytest.raises(DTypeError, match="dim 0 is sharded"):
            iter(y)
        with pytest.raises(DTypeError, match="0-d DTensor"):
            iter(y.sum())
