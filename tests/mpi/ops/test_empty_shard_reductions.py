"""Every reduction and scan of the op table over empty shards, deterministically.

The global tensor's sharded dim is smaller than the mesh dim that shards it, so some
ranks hold empty shards: 1 row (or column) at 2 ranks; 1 and 2 at 3; 3 at 4, where the
2x2 mesh also nests two Shards of 3 rows, or shards 1 column beside an uneven Shard. Each
op of :data:`dtensor.ops.OPS` whose samples are the reduction or scan family runs on
every dtype (float32, float64, int64, bool) with ``dim`` None (reductions), the sharded
dim and both dims (where the op takes a tuple), each with ``keepdim`` False and True, and
the other dim (negative), and ``full_tensor()`` must equal numpy on the global data
(exact for ints and bools). A dtype the op does not define (the mean of ints...) must
raise the local kernel's error on the DTensor too. Keyword options (an accumulation
``dtype``, the norm's ``p``, ``var``'s correction) run on the 1-D mesh. Partial inputs,
where the rule passes them through (``sum`` of ``P(sum)``, ``amax`` of ``P(max)``...),
run with their value on one rank and the identity elsewhere (as ``distribute_tensor``
lays them out) and with random per-rank contributions, alone on the 1-D mesh and beside
an empty Shard on the 2x2 one.

The data are chosen so that a wrong identity shows: the max-like ops see only negative
numbers (floats: a line of -inf along the sharded dim), the min-like ones only positive
numbers (inf), ``any`` only False, ``all`` only True, and the other ops nonzero numbers
of both signs. Nothing depends on the session's seed: every stage runs every case.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from helpers.mpi import meshes
from mpi4py import MPI

import dtensor as dt
from dtensor.ops import OPS
from dtensor.testing import distribute_random

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial

REDUCTIONS = sorted(n for n, i in OPS.items() if i.samples == "reduce" and not i.inplace)
SCANS = sorted(n for n, i in OPS.items() if i.samples == "scan" and not i.inplace)
DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.int64, np.bool_))
_I64 = np.dtype(np.int64)

#: Sizes of the sharded dim on the 1-D mesh: smaller than the world, so that some shards
#: are empty (at 4 ranks, 3: one empty shard; the 2x2 mesh has its own cases).
SIZES = (3,) if WORLD.size == 4 else tuple(range(1, WORLD.size))
#: The Partial kinds each op passes through to its output (the rules' passthrough), by
#: input dtype kind ("f" floats, "i" ints, "b" bools).
PARTIALS = {
    "sum": {"f": ("sum", "avg"), "i": ("sum",)},
    "mean": {"f": ("sum", "avg")},
    "cumsum": {"f": ("sum", "avg"), "i": ("sum",)},
    "prod": {"f": ("prod",), "i": ("prod",)},
    "amax": {"f": ("max",), "i": ("max",), "b": ("max",)},
    "max": {"f": ("max",), "i": ("max",), "b": ("max",)},
    "amin": {"f": ("min",), "i": ("min",), "b": ("min",)},
    "min": {"f": ("min",), "i": ("min",), "b": ("min",)},
    "any": {"b": ("max",)},
    "all": {"b": ("min",)},
}
_MAX_LIKE = ("amax", "max", "argmax")
_MIN_LIKE = ("amin", "min", "argmin")


def test_the_op_table_has_the_reductions_and_scans_checked_here():
    # a new reduction record is checked here by itself; its oracle must exist (below)
    assert set(REDUCTIONS) | set(SCANS) == set(ORACLES), sorted(
        set(REDUCTIONS + SCANS) ^ set(ORACLES))
    assert {"sum", "amax", "argmax", "var", "any"} <= set(REDUCTIONS)
    assert {"cumsum", "cumprod"} <= set(SCANS)


# -- numpy on the global data ------------------------------------------------------------------
def _acc(a):
    """numpy's accumulation dtype of sum/prod/cumsum: int64 for ints and bools (PyTorch)."""
    return _I64 if a.dtype.kind in "biu" else a.dtype


def _axis(dim):
    return dim if dim is None or isinstance(dim, int) else tuple(dim)


def _logsumexp(a, dim, keepdim):
    a64 = a.astype(np.float64)
    m = np.max(a64, axis=_axis(dim), keepdims=True)
    out = m + np.log(np.sum(np.exp(a64 - m), axis=_axis(dim), keepdims=True))
    if not keepdim:
        out = np.squeeze(out, axis=_axis(dim))
    # of ints and bools in the default float dtype (PyTorch)
    return out.astype(a.dtype if a.dtype.kind == "f" else np.float32)


def _values_indices(fn, arg):
    def oracle(a, dim, keepdim):
        if dim is None:
            return fn(a)
        return fn(a, axis=dim, keepdims=keepdim), arg(a, axis=dim, keepdims=keepdim)
    return oracle


def _arg(fn):
    def oracle(a, dim, keepdim):
        # Note (dtensor's, as numpy): dim=None with keepdim=True keeps every dim as size 1
        return fn(a, axis=dim, keepdims=keepdim) if keepdim or dim is not None else fn(a)
    return oracle


#: numpy's result (an array, or a tuple for values and indices) of each op on the global
#: data ``a`` with ``dim`` and ``keepdim`` (None for the scans and count_nonzero).
ORACLES = {
    "sum": lambda a, d, k: np.sum(a, axis=_axis(d), keepdims=k, dtype=_acc(a)),
    "prod": lambda a, d, k: np.prod(a, axis=_axis(d), keepdims=k, dtype=_acc(a)),
    "mean": lambda a, d, k: np.mean(a, axis=_axis(d), keepdims=k, dtype=a.dtype),
    "amax": lambda a, d, k: np.amax(a, axis=_axis(d), keepdims=k),
    "amin": lambda a, d, k: np.amin(a, axis=_axis(d), keepdims=k),
    "max": _values_indices(np.max, np.argmax),
    "min": _values_indices(np.min, np.argmin),
    "argmax": _arg(np.argmax),
    "argmin": _arg(np.argmin),
    "var": lambda a, d, k: np.var(a, axis=_axis(d), keepdims=k, ddof=1),
    "std": lambda a, d, k: np.std(a, axis=_axis(d), keepdims=k, ddof=1),
    "norm": lambda a, d, k: np.sqrt(np.sum(a * a, axis=_axis(d), keepdims=k)),
    "logsumexp": _logsumexp,
    "any": lambda a, d, k: np.any(a, axis=_axis(d), keepdims=k),
    "all": lambda a, d, k: np.all(a, axis=_axis(d), keepdims=k),
    "count_nonzero": lambda a, d, k: np.asarray(np.count_nonzero(a, axis=_axis(d)), _I64),
    "cumsum": lambda a, d, k: np.cumsum(a, axis=d, dtype=_acc(a)),
    "cumprod": lambda a, d, k: np.cumprod(a, axis=d, dtype=_acc(a)),
}



def _pnorm(p):
    def oracle(a, dim, keepdim):
        m = np.abs(a.astype(np.float64))
        ax = _axis(dim)
        if p in (np.inf, -np.inf):
            out = (np.max if p > 0 else np.min)(m, axis=ax, keepdims=keepdim)
        elif p == 0:
            out = np.sum(m != 0, axis=ax, keepdims=keepdim)
        else:
            out = np.sum(m**p, axis=ax, keepdims=keepdim) ** (1 / p)
        return np.asarray(out, a.dtype)
    return oracle


def _as_f64(fn, **kw):
    return lambda a, d, k: fn(a.astype(np.float64), axis=_axis(d), keepdims=k, **kw)


#: Keyword options of the ops (accumulation dtype, p, correction), with numpy's result.
OPTIONS = {
    "sum": [({"dtype": dt.float64}, _as_f64(np.sum))],
    "prod": [({"dtype": dt.float64}, _as_f64(np.prod))],
    "mean": [({"dtype": dt.float64}, _as_f64(np.mean))],
    "cumsum": [({"dtype": dt.float64}, lambda a, d, k: np.cumsum(a, axis=d, dtype=np.float64))],
    "cumprod": [({"dtype": dt.float64},
                 lambda a, d, k: np.cumprod(a, axis=d, dtype=np.float64))],
    "norm": [({"p": p}, _pnorm(p)) for p in (1, np.inf, 0)],
    "var": [({"correction": 0}, lambda a, d, k: np.var(a, axis=_axis(d), keepdims=k))],
    "std": [({"unbiased": False}, lambda a, d, k: np.std(a, axis=_axis(d), keepdims=k))],
}

# -- the cases -----------------------------------------------------------------------------------
def _data(name, shape, dtype, seed, sharded=0):
    """Global data that shows a wrong identity on an empty shard (see the module doc); for
    the max-like (min-like) ops, floats hold one line of -inf (inf) along the ``sharded``
    dim."""
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        if name in ("any", "all"):
            return np.full(shape, name == "all")
        return rng.random(shape) < 0.5
    mag = rng.integers(1, 4, shape) if dtype.kind == "i" else 0.5 + rng.random(shape)
    sign = (-1 if name in _MAX_LIKE else 1 if name in _MIN_LIKE
            else rng.choice(np.array([-1, 1]), shape))
    a = (sign * mag).astype(dtype)
    if dtype.kind == "f" and name in _MAX_LIKE + _MIN_LIKE:
        a[(slice(None), 0) if sharded == 0 else (0, slice(None))] = sign * np.inf
    return a


def _dims(name, sharded, ndim):
    """(dim, keepdim) pairs of the op: None, the sharded dim and both dims (where a tuple is
    taken) with keepdim both ways (where the op has it); the other dim (negative), which
    leaves the empty shards in the output, with keepdim False."""
    other = (1 - sharded) - ndim
    if name in SCANS:
        return [(sharded, None), (other, None)]
    dims = [sharded]
    if name != "logsumexp":
        dims.insert(0, None)  # logsumexp needs a dim (PyTorch)
    if name not in ("max", "min", "argmax", "argmin"):
        dims.append((0, 1))
    if name == "count_nonzero":
        return [(d, None) for d in (*dims, other)]
    return [*itertools.product(dims, (False, True)), (other, False)]


def _call(name, x, dim, keepdim, opts):
    fn = getattr(dt, name)
    if keepdim is None:  # the scans; count_nonzero has no keepdim
        return fn(x, dim=dim, **opts)
    if dim is None and name in ("max", "min"):
        return fn(x)  # the whole tensor's value (keepdim ignored, PyTorch)
    return fn(x, dim=dim, keepdim=keepdim, **opts)


def _layouts(mesh):
    """(sharded tensor dim, placements, global shape) of the cases on ``mesh``, each with an
    empty shard: on the 1-D mesh one Shard of a dim of SIZES rows; on the 2x2 mesh a dim of
    3 sharded on both mesh dims (nested: one of the 4 blocks is empty), or 1 column sharded
    on one mesh dim beside an uneven Shard of the other dim."""
    if mesh.ndim == 1:
        return [(d, (S(d),), (n, 3) if d == 0 else (3, n)) for d in (0, 1) for n in SIZES]
    return [(0, (S(0), S(0)), (3, 3)), (1, (S(0), S(1)), (3, 1))]


def _check(name, got, want, where):
    """``got`` (the op's DTensor output or outputs) against numpy's ``want``."""
    gots = tuple(got) if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    assert len(gots) == len(wants), where
    for g, w in zip(gots, wants):
        w = np.asarray(w)
        assert isinstance(g, dt.DTensor), f"{where}: {type(g).__name__}"
        assert tuple(g.shape) == w.shape, f"{where}: shape {tuple(g.shape)} != {w.shape}"
        full = g.full_tensor().numpy()
        if w.dtype.kind == "f":
            assert full.dtype == w.dtype, f"{where}: dtype {full.dtype} != {w.dtype}"
            rtol = 1e-5 if w.dtype == np.float32 else 1e-12
            np.testing.assert_allclose(full, w, rtol=rtol, atol=rtol, err_msg=where)
        else:
            assert full.dtype == (_I64 if w.dtype.kind == "i" else w.dtype), where
            np.testing.assert_array_equal(full, w, err_msg=where)


def _refusal(name, a, dim, keepdim, opts):
    """The local kernel's error on the global data (an undefined dtype), or None."""
    try:
        _call(name, dt.from_numpy(a), dim, keepdim, opts)
    except Exception as e:  # noqa: BLE001 - the type is what the DTensor must raise too
        return type(e)
    return None


def _run(name, x, a, dim, keepdim, where, opts=None, oracle=None):
    """One case: the DTensor ``x`` of global value ``a`` (the op's keyword ``opts``, numpy's
    ``oracle`` for them); True when it was compared with numpy, False when the op refuses
    the dtype (and the DTensor raised the same error)."""
    opts = opts or {}
    refused = _refusal(name, a, dim, keepdim, opts)
    if refused is not None:
        with pytest.raises(refused):
            _call(name, x, dim, keepdim, opts)
        return False
    with warnings.catch_warnings():  # var of one element: nan (numpy warns)
        warnings.simplefilter("ignore", RuntimeWarning)
        want = (oracle or ORACLES[name])(a, dim, keepdim)
    _check(name, _call(name, x, dim, keepdim, opts), want, where)
    return True


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", REDUCTIONS + SCANS)
def test_empty_shards(name):
    compared = {dt_.name: 0 for dt_ in DTYPES}
    for mesh in meshes():
        for sharded, placements, shape in _layouts(mesh):
            for k, dtype in enumerate(DTYPES):
                a = _data(name, shape, dtype, seed=k, sharded=sharded)
                x = dt.distribute_tensor(a, mesh, placements)
                for dim, keepdim in _dims(name, sharded, len(shape)):
                    where = (f"{name} {dtype.name}{shape} {placements} on {tuple(mesh.shape)}, "
                             f"dim={dim} keepdim={keepdim}")
                    compared[dtype.name] += _run(name, x, a, dim, keepdim, where)
    assert compared["float32"] and compared["float64"], compared
    if name not in ("mean", "var", "std", "norm", "logsumexp"):  # floats only
        assert compared["int64"] and compared["bool"], compared


def _partial_layouts(mesh, kind):
    """(global shape, placements, random contributions?) of the Partial cases on ``mesh``:
    alone on the 1-D mesh; on the 2x2 mesh beside a Shard of 1 row (an empty block), in
    either order."""
    if mesh.ndim == 1:
        return [((SIZES[-1], 3), (P(kind),), spread) for spread in (False, True)]
    return [((1, 3), (S(0), P(kind)), False), ((1, 3), (P(kind), S(0)), True)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(PARTIALS))
def test_partial_inputs_with_empty_shards(name):
    count = 0
    for mesh in meshes():
        for kind_of, kinds in PARTIALS[name].items():
            dtype = next(d for d in DTYPES if d.kind == kind_of)
            for kind in kinds:
                for shape, placements, spread in _partial_layouts(mesh, kind):
                    a = _data(name, shape, dtype, seed=7)
                    x = (distribute_random(a, mesh, placements, seed=3) if spread
                         else dt.distribute_tensor(a, mesh, placements))
                    for dim, keepdim in _dims(name, 0, len(shape)):
                        where = (f"{name} {dtype.name}{shape} {placements} on "
                                 f"{tuple(mesh.shape)}{' (random contributions)' * spread}, "
                                 f"dim={dim} keepdim={keepdim}")
                        assert _run(name, x, a, dim, keepdim, where), where
                        count += 1
    assert count


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_empty_shards_with_options(name):
    # on the 1-D mesh: the nested and 2-D layouts are the plain test's
    compared = 0
    mesh = meshes()[0]
    for (sharded, placements, shape), (opts, oracle) in itertools.product(
            _layouts(mesh), OPTIONS[name]):
        for k, dtype in enumerate(DTYPES):
            a = _data(name, shape, dtype, seed=k, sharded=sharded)
            x = dt.distribute_tensor(a, mesh, placements)
            for dim, keepdim in _dims(name, sharded, len(shape)):
                where = f"{name}({opts}) {dtype.name}{shape} {placements}, dim={dim} keepdim={keepdim}"
                compared += _run(name, x, a, dim, keepdim, where, opts, oracle)
    assert compared
