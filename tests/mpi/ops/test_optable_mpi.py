"""Every op of the table on real meshes: the validator's sample calls under MPI.

For each record of :data:`dtensor.ops.OPS` (in-place ops and the ops behind python
operators included) the test takes the strategy validator's sample calls
(:func:`dtensor.validate.sample_calls`: even, uneven and empty shards; float, int and bool
data; python scalars; broadcasting) and runs each one on the 1-D world mesh under two
layouts or, at 4 ranks, under one layout on the 1-D and the 2x2 mesh in turn. A layout
gives every tensor argument placements: Replicate, Shard of a dim (dims smaller than the
mesh dim among them) and Partial sum/avg/max/min (avg of floats only: dtensor averages no
other dtype) whose per-rank contributions are random
(:func:`dtensor.testing.distribute_random`). The op runs through its public DTensor form
(``dt.<name>``, the method or a python operator, in turn), and every output must be a
DTensor whose shape, dtype and ``full_tensor()`` equal the op's local kernel on the global
data (the validator's expected outputs: exact for ints and bools, NaNs where they are for
floats); an in-place op must return its first argument, with that argument's placements
unchanged, holding the result.

The only refusal accepted is the dispatcher's ShardingError for an in-place op whose input
placements no strategy keeps (``relu_`` of a ``P(sum)`` tensor); a refused layout is
counted and replaced by one without Partial inputs, and an op must check at least one
call. Placements are drawn from the ``rng`` fixture (the same on every rank), per op the
kind used least so far, so that every kind appears and control flow is identical on all
ranks. The test of op ``NAME`` is ``test_op[NAME]`` (``-k NAME`` selects it).
"""

from __future__ import annotations

import functools
import inspect
import operator
import zlib
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from helpers.mpi import meshes_dp_tp
from mpi4py import MPI

import dtensor as dt
from dtensor.ops import OPS
from dtensor.testing import distribute_random
from dtensor.validate import SampleCall, sample_calls
from placements.errors import ShardingError
from placements.meta import dtype_kind
from placements.types import placement_list

WORLD = MPI.COMM_WORLD
R = dt.Replicate()
_PARTIALS = ("sum", "avg", "max", "min")
#: checked placement combinations per call: two on the world mesh below 4 ranks; at 4 ranks
#: the calls alternate between the 1-D and the 2x2 mesh, one combination each
_PER_CALL = 2 if WORLD.size < 4 else 1
_NAMES = sorted(OPS)
#: every op checked in this session: op name -> (checked calls, refused layouts)
CHECKED: dict[str, tuple[int, int]] = {}
#: how often each kind of placement was laid out in this session (over every op)
KINDS: Counter = Counter()


@functools.cache
def _calls(name: str) -> list[SampleCall]:
    return sample_calls(OPS[name], seed=zlib.crc32(name.encode()))


# -- placements ----------------------------------------------------------------------------------
def _kinds(value: np.ndarray, size: int, partial: bool) -> dict[str, list[dt.Placement]]:
    """The placement kinds ``value`` may take on a mesh dim of ``size`` ranks (Partial ones
    only if ``partial``)."""
    kinds: dict[str, list[dt.Placement]] = {"R": [R]}
    small = [dt.Shard(d) for d in range(value.ndim) if value.shape[d] < size]
    other = [dt.Shard(d) for d in range(value.ndim) if value.shape[d] >= size]
    if small:
        kinds["S<mesh"] = small
    if other:
        kinds["S"] = other
    for op in _PARTIALS if partial else ():
        if op != "avg" or value.dtype.kind in "fc":  # dtensor averages floats only
            kinds[f"P({op})"] = [dt.Partial(op)]
    return kinds


def _pick(
    value: np.ndarray, mesh: dt.DeviceMesh, used: Counter, rng: np.random.Generator,
    partial: bool,
) -> tuple[dt.Placement, ...]:
    """Placements of ``value`` on ``mesh``: per mesh dim the kind this op used least so far
    (ties broken by ``rng``), then one placement of that kind."""
    out = []
    for size in mesh.shape:
        kinds = _kinds(value, size, partial)
        names = sorted(kinds)
        least = min(used[k] for k in names)
        ties = [k for k in names if used[k] == least]
        kind = ties[rng.integers(len(ties))]
        used[kind] += 1
        choices = kinds[kind]
        out.append(choices[rng.integers(len(choices))])
    return tuple(out)


# -- calling the op through its public forms -------------------------------------------------------
def _at_default(call: SampleCall, start: int) -> bool:
    """Whether every parameter from index ``start`` on holds its default."""
    info = call.info
    for p, v in zip(info.params[start:], call.values[start:]):
        d = info.defaults.get(p, object())
        if not (v is d or (type(v) is type(d) and not isinstance(v, np.ndarray) and v == d)):
            return False
    return True


@functools.cache
def _kinds_of(local: Callable) -> tuple | None:
    """The kinds of ``local``'s parameters (``out`` left out); None for ``(self, *args,
    **kwargs)``: every argument positional."""
    params = [p for p in inspect.signature(local).parameters.values() if p.name != "out"]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return tuple((p.name, p.kind) for p in params)


def _split(local: Callable, values: list) -> tuple[list, dict]:
    """Positional and keyword arguments of a call with one value per parameter, as the
    signature of ``local`` (the record's local function or method) takes them: keyword-only
    parameters by keyword, a ``*args`` parameter unpacked."""
    kinds = _kinds_of(local)
    if kinds is None:
        return list(values), {}
    args: list = []
    kwargs: dict = {}
    for (name, kind), v in zip(kinds, values):
        if kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[name] = v
        elif kind is inspect.Parameter.VAR_POSITIONAL and isinstance(v, (list, tuple)):
            args.extend(v)
        else:
            args.append(v)
    return args, kwargs


def _set_and_return(x: object, idx: object, value: object) -> object:
    """``x[idx] = value``, then ``x`` (what the in-place op returns)."""
    x[idx] = value  # type: ignore[index]
    return x


def _forms(call: SampleCall, values: list) -> list[tuple[str, Callable[[], object]]]:
    """The public DTensor forms that can run ``call`` on ``values`` (one per parameter,
    DTensors in the tensor slots): the function, the method, the python operators; each as
    (how it is called, a callable of no argument)."""
    info = call.info
    forms = []
    if info.function is not None:
        args, kwargs = _split(info.function, values)
        forms.append((f"dt.{info.name}", functools.partial(getattr(dt, info.name), *args,
                                                             **kwargs)))
    if info.method is not None:
        if info.method_args is None:
            margs, mkwargs = _split(info.method, values)
        else:  # x.where(cond, y): the op's argument i is the method's argument order[i]
            margs, mkwargs = [None] * len(values), {}
            for i, j in enumerate(info.method_args):
                margs[j] = values[i]
        if isinstance(margs[0], dt.DTensor):
            method = getattr(margs[0], info.name)
            forms.append((f"x.{info.name}", functools.partial(method, *margs[1:], **mkwargs)))
    for op in info.operators:
        if op.dunder == "__setitem__":  # x[idx] = value: a statement; its result is x
            forms.append((op.dunder, functools.partial(_set_and_return, *values)))
            continue
        if op.form == "method":  # x[idx]
            forms.append((op.dunder, functools.partial(getattr(operator, op.dunder), *values)))
            continue
        n = 1 if op.form == "unary" else 2
        if not _at_default(call, n) or isinstance(values[0], dt.DTensor) == (
            op.form == "reflected"
        ):
            continue  # extra arguments, or a reflected operator without a scalar first operand
        # python itself turns ``2 + x`` into ``x.__radd__(2)``: call the plain operator
        dunder = op.dunder.replace("__r", "__", 1) if op.form == "reflected" else op.dunder
        forms.append((op.dunder, functools.partial(getattr(operator, dunder), *values[:n])))
    return forms


# -- one call ---------------------------------------------------------------------------------------
def _layout(call: SampleCall, mesh, used: Counter, rng, partial: bool) -> tuple[list, list, bool]:
    """The call's bound values with DTensors in the tensor slots; the placements of each
    slot (None for a non-tensor); whether a float argument holds sum/avg contributions."""
    args = [list(v) if isinstance(v, list) else v for v in call.values]
    placements = []
    rounded = False
    for slot in call.slots:
        v = call.arg(slot)
        if not isinstance(v, np.ndarray):
            placements.append(None)
            continue
        pl = _pick(v, mesh, used, rng, partial)
        placements.append(pl)
        rounded |= v.dtype.kind == "f" and any(
            p.is_partial() and p.reduce_op in ("sum", "avg") for p in pl
        )
        x = distribute_random(v, mesh, pl, seed=int(rng.integers(2**31)))
        pi, ei = slot
        if ei < 0:
            args[pi] = x
        else:
            args[pi][ei] = x
    return args, placements, rounded


def _check_output(got: dt.Tensor, want: np.ndarray, tol: float, what: str) -> None:
    g = got.numpy()
    assert g.shape == want.shape, f"{what}: shape {g.shape}, expected {want.shape}"
    assert g.dtype == want.dtype, f"{what}: dtype {g.dtype}, expected {want.dtype}"
    if dtype_kind(want.dtype) in "fc":  # (bfloat16 included)
        ok = np.isclose(g, want, rtol=tol, atol=tol, equal_nan=True)
        if not ok.all():
            bad = np.argwhere(~ok)[:3].tolist()
            raise AssertionError(
                f"{what}: values differ at {bad}: got {g[~ok][:3]}, expected {want[~ok][:3]} "
                f"(rtol=atol={tol})"
            )
    else:
        assert np.array_equal(g, want), f"{what}: values differ:\n{g}\nexpected\n{want}"


def _run(call: SampleCall, mesh, used: Counter, rng, form_index: int, partial: bool) -> bool:
    """Run ``call`` on ``mesh`` once (Partial inputs only if ``partial``); True when checked,
    False when refused (the one refusal accepted)."""
    info = call.info
    args, placements, rounded = _layout(call, mesh, used, rng, partial)
    forms = _forms(call, args)
    assert forms, f"{info.name} {call.label}: no public DTensor form takes these arguments"
    how, fn = forms[form_index % len(forms)]
    what = f"{info.name} {call.label} via {how} on mesh {tuple(mesh.shape)} with " + ", ".join(
        "-" if p is None else placement_list(p) for p in placements
    )
    first = args[0]
    before = first.placements if isinstance(first, dt.DTensor) else None
    dt.set_rng_state(call.rng_state)
    try:
        out = fn()
    except ShardingError as exc:
        if info.inplace and "in-place" in str(exc):
            return False  # no strategy keeps the in-place input's placements
        raise AssertionError(f"{what}: refused: {type(exc).__name__}: {exc}") from exc
    try:
        _check(call, out, first, before, rounded, what)
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"{what}: {type(exc).__name__}: {exc}") from exc
    return True


def _check(call: SampleCall, out: object, first: object, before, rounded: bool, what: str):
    """``out`` (and, for an in-place op, its first argument) against the expected outputs."""
    info = call.info
    outs = [out] if isinstance(out, dt.DTensor) else list(out)  # type: ignore[call-overload]
    assert len(outs) == len(call.want), f"{what}: {len(outs)} outputs, expected {len(call.want)}"
    tol = call.tolerance * (10 if rounded else 1)
    for k, (o, want) in enumerate(zip(outs, call.want)):
        assert isinstance(o, dt.DTensor), f"{what}: output {k} is a {type(o).__name__}"
        assert (tuple(o.shape), o.dtype) == (want.shape, want.dtype), (
            f"{what}: output {k} is a DTensor of {o.dtype}{tuple(o.shape)}, expected "
            f"{want.dtype}{want.shape}"
        )
        _check_output(o.full_tensor(), want, tol, f"{what}: output {k}")
    if info.inplace:
        assert out is first, f"{what}: the in-place op did not return its first argument"
        assert first.placements == before, (
            f"{what}: the in-place op changed its input's placements {before} to "
            f"{first.placements}"  # type: ignore[union-attr]
        )


# -- the tests --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def meshes() -> list[dt.DeviceMesh]:
    """The meshes of :func:`helpers.mpi.meshes_dp_tp` (collective: every rank builds them)."""
    return meshes_dp_tp()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", _NAMES)
def test_op(name: str, meshes, rng) -> None:
    """Every sample call of ``name``, under layouts that give each kind of placement its turn."""
    calls = _calls(name)
    assert calls, f"{name}: the validator has no sample calls for it"
    used: Counter = Counter()
    checked = refused = 0
    with np.errstate(all="ignore"):
        for i, call in enumerate(calls):
            mesh = meshes[i % len(meshes)]
            # A refused layout (a Partial an in-place op cannot keep) makes room for one
            # without Partial inputs, which every op keeps; every rank refuses alike.
            want, partial = _PER_CALL, True
            for j in range(2 * _PER_CALL):
                if _run(call, mesh, used, rng, i + j, partial):
                    checked += 1
                    want -= 1
                    if not want:
                        break
                else:
                    refused += 1
                    partial = False
    assert checked, f"{name}: every call was refused ({refused} refusals)"
    CHECKED[name] = (checked, refused)
    KINDS.update(used)


@pytest.mark.mpi(min_size=1)
def test_every_op_is_checked(request: pytest.FixtureRequest) -> None:
    """Every record of the table has sample calls; when the whole table ran in this session,
    the ops checked are exactly the records of the table, and every kind of placement was
    laid out (shards of dims smaller than the mesh among them)."""
    missing = [n for n in _NAMES if not _calls(n)]
    assert not missing, f"ops without sample calls in the validator: {', '.join(missing)}"
    selected = {item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_op"}
    if selected == set(OPS):
        assert set(CHECKED) == set(OPS), f"ops not checked: {sorted(set(OPS) - set(CHECKED))}"
        kinds = {"R", "S", "P(sum)", "P(avg)", "P(max)", "P(min)"}
        kinds |= {"S<mesh"} if WORLD.size > 1 else set()
        assert kinds <= set(KINDS), f"kinds never laid out: {sorted(kinds - set(KINDS))}"
