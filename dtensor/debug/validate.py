"""The strategy validator: every candidate of every sharding rule, checked on data.

For every op of the table (:data:`dtensor.ops.OPS`) and a set of sample calls (even,
uneven and empty-shard shapes; float, int and bool dtypes where meaningful; python
scalars; broadcasting), on meshes (2,), (3,), (4,) and (2, 2), in ONE process:

1. the op's rule gives the output shapes/dtypes and its 1-D candidates;
2. each candidate (on 1-D meshes), each valid N-D combination of candidates (on the 2-D
   mesh) and the strategy :func:`placements.rules.propagate` chooses for random input
   placements is checked: every input is laid out under the strategy's input placements for
   EVERY mesh coordinate (a Partial input is split into random per-coordinate
   contributions that reduce to the global data; a python scalar split into ``P(sum)`` is
   kept by the holder, 0 elsewhere), the op's local kernel (through its ``local_fn``, if
   any) runs per coordinate, and the outputs are combined per the output placements
   (Partial contributions reduced, shards stitched, replicas compared bit for bit; every
   local output must have the shape and dtype its spec promises); the kernels of a
   strategy whose candidates communicate (:attr:`placements.rules.Candidate.collective`)
   run one thread per coordinate, their all-reduces over simulated communicators of the
   mesh dims;
3. the combined result is compared with the local kernel applied to the global inputs
   (``allclose`` for floats, exact for ints and bools), as are the rule's shapes and dtypes.

The sample calls are the op families' own (:mod:`dtensor.ops.samples`). A call whose
global kernel raises (an unsupported dtype, say) is skipped. The sample calls,
bound to their op and with their global results, are public (:func:`sample_calls`) for tests
that run them on real meshes. Run
``python -m dtensor.validate [--quick] [--op NAME ...]``: it prints one row per op and a
summary line, and exits non-zero on any mismatch. **Local**: no MPI anywhere.
"""

from __future__ import annotations

import argparse
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from placements import Partial, Placement, Replicate, Shard
from placements.errors import CommError
from placements.layout import local_slices
from placements.meta import dtype_kind, is_bfloat16
from placements.rules import (
    ArgMeta,
    Candidate,
    OpSchema,
    OpStrategy,
    nd_valid,
    propagate,
    rule_result,
    strategy_of,
)

from ..distributed.abstract import AbstractMesh
from ..local import rng as _random
from ..local.quiet import quiet_call
from ..local.tensor import Tensor, wrap_array
from ..ops import OPS, OpInfo
from ..ops.samples import FAMILIES, QUICK_SHAPES, SHAPES, Case, Gen, cases
from ..testing import blocks

__all__ = ["Report", "SampleCall", "main", "sample_calls", "validate"]

MESHES: tuple[tuple[int, ...], ...] = ((2,), (3,), (4,), (2, 2))
_R = Replicate()
_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)


class _SimGroup:
    """The coordinates of one mesh-dim communicator, run as threads: a barrier and one slot
    per member."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list = [None] * size
        # point-to-point: (source, dest, tag) -> the messages sent, in order
        self.mail: dict[tuple[int, int, int], list] = {}
        self.posted = threading.Condition()


_SIM_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


class _SimComm:
    """One coordinate's view of a :class:`_SimGroup` (a group of its coordinate
    :class:`AbstractMesh`): the all-reduce kernels call, and the point-to-point messages of
    ring attention (a send is a copy left in the group's mailbox, complete at once; a
    receive takes it at the wait)."""

    def __init__(self, group: _SimGroup, rank: int) -> None:
        self.group, self.rank = group, rank
        self.size = group.size

    def isend(self, arr: np.ndarray, dest: int, tag: int = 0, what: object = None) -> None:
        g = self.group
        with g.posted:
            g.mail.setdefault((self.rank, dest, tag), []).append(arr.copy())
            g.posted.notify_all()

    def irecv(self, arr: np.ndarray, source: int, tag: int = 0, what: object = None) -> tuple:
        return (arr, (source, self.rank, tag))

    def wait_all(self, requests: Sequence) -> None:
        g = self.group
        for r in requests:
            if r is None:
                continue
            arr, key = r
            with g.posted:
                box = g.mail.setdefault(key, [])
                if not g.posted.wait_for(lambda b=box: b or g.barrier.broken,
                                         timeout=60) or g.barrier.broken:
                    raise CommError(f"validator: no message {key} (or a member failed)")
                arr[...] = box.pop(0)

    def test_all(self, requests: Sequence) -> bool:
        return False

    def allreduce(self, send: np.ndarray, recv: np.ndarray | None = None, op: str = "sum",
                  what: object = None) -> None:
        g = self.group
        g.slots[self.rank] = send.copy()
        g.barrier.wait()
        total = _SIM_REDUCE[op](np.stack(g.slots), axis=0)  # one order: equal on every member
        g.barrier.wait()
        (send if recv is None else recv)[...] = total


def _sim_comms(mesh_shape: tuple[int, ...]) -> dict[tuple[int, ...], tuple[_SimComm, ...]]:
    """Per coordinate, one simulated communicator per mesh dim (the coordinates that differ
    on that dim only form its group)."""
    groups: dict[tuple, _SimGroup] = {}
    out = {}
    for coord in np.ndindex(*mesh_shape):
        comms = []
        for m, n in enumerate(mesh_shape):
            key = (m, coord[:m] + coord[m + 1 :])
            comms.append(_SimComm(groups.setdefault(key, _SimGroup(n)), coord[m]))
        out[coord] = tuple(comms)
    return out


def _per_coordinate(run: Callable, mesh_shape: tuple[int, ...], threads: bool) -> None:
    """``run(coord, comms)`` for every coordinate: in turn (``comms`` empty), or
    (``threads``) at once, one thread each, with simulated communicators; the first
    exception is raised again (a failing member aborts the barriers, so that the others do
    not wait for it)."""
    if not threads:
        for coord in np.ndindex(*mesh_shape):
            run(coord, ())
        return
    comms = _sim_comms(mesh_shape)
    errors: list[BaseException] = []

    def body(coord: tuple[int, ...]) -> None:
        try:
            run(coord, comms[coord])
        except BaseException as exc:  # noqa: BLE001 - raised again by the caller
            errors.append(exc)
            for cs in comms.values():  # release the members waiting for this one
                for c in cs:
                    c.group.barrier.abort()

    workers = [threading.Thread(target=body, args=(c,)) for c in np.ndindex(*mesh_shape)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]  # the first: those after it were released by its abort


# -- laying out inputs, combining outputs --------------------------------------------------------
_SCALARS = (bool, int, float)


def _reduce(op: str, parts: list[np.ndarray]) -> np.ndarray:
    if op == "sum":
        return np.sum(parts, axis=0, dtype=parts[0].dtype)
    if op == "avg":
        out = np.sum(parts, axis=0, dtype=parts[0].dtype) / len(parts)
        return out.astype(parts[0].dtype)
    if op == "max":
        return np.maximum.reduce(parts)
    if op == "min":
        return np.minimum.reduce(parts)
    return np.prod(parts, axis=0, dtype=parts[0].dtype)


class _NotApplicable(Exception):
    """A strategy that cannot be exercised with these inputs (e.g. P(sum) of bools)."""


class _Mismatch(Exception):
    """A strategy whose combined result differs from the global one."""


def _layout(
    g: np.ndarray,
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    rng: np.random.Generator,
) -> dict[tuple[int, ...], np.ndarray]:
    """Every coordinate's local block of ``g`` (Partial mesh dims split into random
    contributions, outer first)."""
    if g.dtype == _BOOL:
        for p in placements:
            if p.kind == "P" and p.reduce_op in ("sum", "avg"):
                raise _NotApplicable(f"P({p.reduce_op}) of a bool tensor")
    return blocks(g, mesh_shape, placements, rng)


def _copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy with row-major strides (also for empty arrays)."""
    out = np.empty(a.shape, a.dtype)
    out[...] = a
    return out


def _scalar_local(v: object, placements: tuple[Placement, ...], coord: tuple[int, ...]) -> object:
    """A scalar operand on one coordinate: split into ``P(sum)``/``P(prod)`` it is held by
    coordinate 0 of that mesh dim, the others hold the identity."""
    for m, p in enumerate(placements):
        if p.kind == "P" and coord[m] != 0 and p.reduce_op in ("sum", "prod"):
            return type(v)(0 if p.reduce_op == "sum" else 1)
    return v


def _combine(
    locs: dict[tuple[int, ...], np.ndarray],
    placements: tuple[Placement, ...],
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
) -> np.ndarray:
    """The global array that per-coordinate outputs ``locs`` represent under ``placements``."""
    grid = dict(locs)
    for m in reversed(range(len(mesh_shape))):  # Partial: innermost (highest) mesh dim first
        p = placements[m]
        if p.kind != "P":
            continue
        nxt = {}
        for coord in grid:
            if coord[m] != 0:
                continue
            parts = [grid[coord[:m] + (i,) + coord[m + 1 :]] for i in range(mesh_shape[m])]
            if any(q.shape != parts[0].shape for q in parts):
                raise _Mismatch(f"Partial contributions of different shapes on mesh dim {m}")
            nxt[coord] = _reduce(p.reduce_op, parts)
        grid = nxt
    plain = tuple(_R if p.kind == "P" else p for p in placements)
    out = np.zeros(shape, dtype=next(iter(grid.values())).dtype)
    covered = np.zeros(shape, dtype=np.int64)
    seen: dict[tuple, tuple[tuple[int, ...], np.ndarray]] = {}
    for coord, val in grid.items():
        sl = local_slices(shape, mesh_shape, plain, coord)
        key = tuple((s.start, s.stop) for s in sl)
        if key in seen:
            other_coord, other = seen[key]
            if not np.array_equal(other, val, equal_nan=dtype_kind(val.dtype) in "fc"):
                raise _Mismatch(
                    f"replicas differ: coordinates {other_coord} and {coord} hold different "
                    "values for the same block"
                )
            continue
        seen[key] = (coord, val)
        out[sl] = val
        covered[sl] += 1
    if not (covered == 1).all():
        raise _Mismatch("the output shards do not cover the global tensor exactly once")
    return out


def _compare(got: np.ndarray, want: np.ndarray, tol: float) -> str | None:
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    if dtype_kind(want.dtype) in "fc":
        if not np.allclose(got, want, rtol=tol, atol=tol, equal_nan=True):
            diff = np.nanmax(np.abs(got.astype(np.float64) - want.astype(np.float64)))
            return f"values differ (max abs diff {diff:.3g})"
    elif not np.array_equal(got, want):
        return "values differ"
    return None


def _outputs(out: object) -> list[np.ndarray]:
    """The arrays of a kernel's output Tensor(s); each must wrap an ndarray."""
    outs = [out] if isinstance(out, Tensor) else list(out)  # type: ignore[call-overload]
    for o in outs:
        if not isinstance(o, Tensor) or not isinstance(o._arr, np.ndarray):
            raise _Mismatch(f"the kernel returned {type(o).__name__} over "
                            f"{type(getattr(o, '_arr', None)).__name__}, not a Tensor over an "
                            "ndarray")
    return [o._arr for o in outs]


# -- one op, one case ------------------------------------------------------------------------------
_TOL = {1: 5e-2, 2: 1e-2, 4: 1e-4, 8: 1e-10, 16: 1e-10}


def _precision(dtype: np.dtype) -> int | None:
    """The key of a float dtype's tolerance in :data:`_TOL` (bytes per real value; 1 for
    bfloat16, which keeps 3 fewer significand bits than float16), None for other dtypes."""
    kind = dtype_kind(dtype)
    if kind not in "fc":
        return None
    return 1 if is_bfloat16(dtype) else dtype.itemsize // (2 if kind == "c" else 1)


@dataclass
class SampleCall:
    """A sample call bound to an op, with its global result.

    Attributes
    ----------
    info : OpInfo
        The op.
    label : str
        The sample's label (dtype, shapes, options).
    values : list
        One value per parameter of ``info.params`` (defaults filled in): numpy arrays stand
        for tensors, a list for the ``variadic`` parameter; scalars and statics as they are.
    slots : list of (int, int)
        The tensor arguments, in ``OpSchema.args`` order: (parameter index, element index
        in the variadic list or -1). A slot may hold a python scalar or None.
    static : tuple of (str, object)
        The decision-relevant static parameters and their values.
    want : list of numpy.ndarray
        The op's local kernel applied to the global values: the expected global outputs.
    rng_state : Tensor
        The state of dtensor's random generator the kernel ran from (``dropout``): restore
        it with ``dt.set_rng_state`` before running the call again.
    """

    info: OpInfo
    label: str
    values: list[object]
    slots: list[tuple[int, int]]  # (param index, element index or -1)
    static: tuple[tuple[str, object], ...]
    want: list[np.ndarray]
    rng_state: Tensor

    def arg(self, slot: tuple[int, int]) -> object:
        """The value in ``slot`` (one of :attr:`slots`). **Local**."""
        pi, ei = slot
        return self.values[pi] if ei < 0 else self.values[pi][ei]  # type: ignore[index]

    @property
    def tolerance(self) -> float:
        """Relative and absolute tolerance of float outputs: that of the least precise float
        among inputs and outputs (Partial contributions are split in the input dtype,
        outputs reduced in theirs); 0.0 when none is a float. **Local**."""
        dtypes = [w.dtype for w in self.want] + [
            v.dtype for v in map(self.arg, self.slots) if isinstance(v, np.ndarray)]
        sizes = [p for p in map(_precision, dtypes) if p is not None]
        return _TOL[min(sizes)] if sizes else 0.0


def _as_kernel_value(v: object) -> object:
    if isinstance(v, np.ndarray):
        return wrap_array(_copy(v))
    if isinstance(v, list):
        return [_as_kernel_value(e) for e in v]
    return v


def _bind(info: OpInfo, case: Case) -> SampleCall | None:
    """Bind ``case`` to ``info``'s parameters and run the global kernel (None: it raised)."""
    values: list[object] = []
    for p in info.params:
        if p in case.values:
            values.append(case.values[p])
        elif p in info.defaults:
            values.append(info.defaults[p])
        else:
            raise KeyError(f"validator: case {case.label!r} of {info.name} lacks {p!r}")
    slots = []
    for p in info.tensor_params:
        pi = info.params.index(p)
        if p == info.variadic:
            slots.extend((pi, ei) for ei in range(len(values[pi])))  # type: ignore[arg-type]
        else:
            slots.append((pi, -1))
    state = _random.get_rng_state()
    try:
        _random.set_rng_state(state)
        out = quiet_call(info.kernel, *[_as_kernel_value(v) for v in values])  # (as dispatch)
    except Exception:  # noqa: BLE001 - the op does not take these inputs on one device
        return None
    static = tuple((p, values[info.params.index(p)]) for p in info.static_params)
    return SampleCall(info, case.label, values, slots, static, _outputs(out), state)


def sample_calls(info: OpInfo, seed: int = 0) -> list[SampleCall]:
    """The validator's quick sample calls of ``info``, bound to its parameters. **Local**.

    The cases of the op's ``samples`` family on the quick shapes (even, uneven and empty
    shards on meshes of up to 4; float, int and bool dtypes where meaningful; python
    scalars; broadcasting), each bound as the validator binds it, with the op's local kernel
    applied to the global values as the expected outputs (:attr:`SampleCall.want`). Cases
    the kernel refuses are left out. dtensor's random generator is left as it was.

    Parameters
    ----------
    info : OpInfo
        The op (a record of :data:`dtensor.ops.OPS`).
    seed : int
        Seeds the sample data.

    Returns
    -------
    list of SampleCall
        Empty when the op names no sample family of the validator (``info.samples``) or
        the kernel refuses every case.

    Raises
    ------
    Exception
        The validator's mismatch error when the kernel returns something other than
        Tensors over ndarrays.
    """
    if info.samples not in FAMILIES:
        return []
    state = _random.get_rng_state()
    try:
        with np.errstate(all="ignore"):
            calls = [_bind(info, case) for case in cases(info, Gen(seed), QUICK_SHAPES)]
    finally:
        _random.set_rng_state(state)
    return [c for c in calls if c is not None]


def _meta(v: object, placements: tuple[Placement, ...] | None) -> ArgMeta | None:
    if v is None:
        return None
    if isinstance(v, _SCALARS):
        dt = {bool: _BOOL, int: _I64, float: _F32}[type(v)]
        return ArgMeta((), dt, None, True)
    return ArgMeta(tuple(v.shape), v.dtype, placements)  # type: ignore[attr-defined]


def _schema(call: SampleCall, mesh_shape: tuple[int, ...], current: Sequence) -> OpSchema:
    metas = tuple(_meta(call.arg(s), cur) for s, cur in zip(call.slots, current))
    return OpSchema(call.info.rule, metas, call.static, mesh_shape)


def _run_strategy(
    call: SampleCall,
    schema: OpSchema,
    combo: tuple[Candidate, ...],
    rng: np.random.Generator,
) -> None:
    """Lay out, run per coordinate, combine and compare one N-D strategy."""
    info = call.info
    mesh_shape = schema.mesh_shape
    result = rule_result(schema)
    n_out = len(result.out_shapes)
    if [r.shape for r in call.want] != list(result.out_shapes):
        raise _Mismatch(f"rule shapes {result.out_shapes} != kernel {[w.shape for w in call.want]}")
    if [w.dtype for w in call.want] != list(result.out_dtypes):
        raise _Mismatch(f"rule dtypes {result.out_dtypes} != kernel {[w.dtype for w in call.want]}")
    # per argument, its target N-D placements (as the dispatcher would move it)
    targets = list(strategy_of(schema, AbstractMesh(mesh_shape), result, combo, 0.0, ())
                   .input_placements)
    layouts = []
    for slot, target in zip(call.slots, targets):
        v = call.arg(slot)
        layouts.append(_layout(v, target, mesh_shape, rng) if isinstance(v, np.ndarray) else None)
    locs: list[dict] = [{} for _ in range(n_out)]

    def run(coord: tuple[int, ...], comms: tuple) -> None:
        mesh = AbstractMesh(mesh_shape, coord=coord, groups=comms or None)
        strategy: OpStrategy = strategy_of(schema, mesh, result, combo, 0.0, ())
        values = list(call.values)
        if info.variadic is not None:
            vi = info.params.index(info.variadic)
            values[vi] = list(values[vi])  # type: ignore[arg-type]
        for slot, target, lay in zip(call.slots, targets, layouts):
            v = call.arg(slot)
            if lay is not None:
                local: object = wrap_array(lay[coord])
            elif isinstance(v, _SCALARS):
                local = _scalar_local(v, target, coord)  # type: ignore[arg-type]
            else:
                local = v
            pi, ei = slot
            if ei < 0:
                values[pi] = local
            else:
                values[pi][ei] = local  # type: ignore[index]
        kernel = info.local_fn(schema, strategy) if info.local_fn is not None else info.kernel
        _random.set_rng_state(call.rng_state)
        try:
            outs = _outputs(quiet_call(kernel, *values))  # (as dispatch runs it; a thread
            # of a collective strategy does not inherit the caller's numpy error state)
        except Exception as exc:
            raise _Mismatch(f"local kernel raised on {coord}: {type(exc).__name__}: {exc}") from exc
        for k, (o, spec) in enumerate(zip(outs, strategy.output_specs)):
            want_shape = spec.local_shape(coord)
            if o.shape != want_shape or o.dtype != spec.dtype:
                raise _Mismatch(
                    f"output {k} on {coord}: local {o.dtype}{o.shape}, spec promises "
                    f"{spec.dtype}{want_shape} ({spec})"
                )
            locs[k][coord] = o

    _per_coordinate(run, mesh_shape, any(c.collective for c in combo))
    for k in range(n_out):
        out_pl = tuple(c.placements[k] for c in combo)
        got = _combine(locs[k], out_pl, result.out_shapes[k], mesh_shape)
        err = _compare(got, call.want[k], call.tolerance)
        if err:
            raise _Mismatch(f"output {k}: {err}")


def _combos(
    result, mesh_shape: tuple[int, ...], limit: int | None, rng: np.random.Generator
) -> list[tuple[Candidate, ...]]:
    allc = [
        combo
        for combo in itertools.product(result.candidates, repeat=len(mesh_shape))
        if nd_valid(result, combo)
    ]
    if limit is not None and len(allc) > limit:
        pick = sorted(rng.choice(len(allc), limit, replace=False))
        allc = [allc[i] for i in pick]
    return allc


def _random_current(
    call: SampleCall, mesh_shape: tuple[int, ...], rng: np.random.Generator
) -> list[tuple[Placement, ...] | None]:
    out = []
    for slot in call.slots:
        v = call.arg(slot)
        if not isinstance(v, np.ndarray):
            out.append(None)
            continue
        choices: list[Placement] = [_R, Partial("sum"), Partial("max")]
        choices += [Shard(d) for d in range(v.ndim)]
        if v.dtype == _BOOL:
            choices.remove(Partial("sum"))
        out.append(tuple(choices[i] for i in rng.integers(0, len(choices), len(mesh_shape))))
    return out


def _fake_cost(meta: ArgMeta, target: tuple[Placement, ...]) -> float:
    """Bytes-like cost: elements times the number of mesh dims whose placement changes."""
    changed = sum(a != b for a, b in zip(meta.placements, target))  # type: ignore[arg-type]
    return float(changed * (math.prod(meta.shape) + 1))


# -- the run -------------------------------------------------------------------------------------
@dataclass
class OpReport:
    """Counts for one op."""

    name: str
    rule: str
    cases: int = 0
    skipped: int = 0
    candidates: int = 0
    strategies: int = 0
    not_applicable: int = 0
    refused: int = 0
    mismatches: list[str] = field(default_factory=list)


@dataclass
class Report:
    """The validator's result: one :class:`OpReport` per op, and the wall time."""

    ops: list[OpReport]
    seconds: float

    @property
    def mismatches(self) -> int:
        return sum(len(r.mismatches) for r in self.ops)

    def summary(self) -> str:
        cands = sum(r.candidates for r in self.ops)
        strategies = sum(r.strategies for r in self.ops)
        cases = sum(r.cases for r in self.ops)
        return (
            f"{len(self.ops)} ops, {cands} candidates, {cases} cases, {strategies} strategies "
            f"checked, {self.mismatches} mismatches ({self.seconds:.1f} s)"
        )

    def table(self) -> str:
        head = f"{'op':<16}{'rule':<16}{'cases':>6}{'skip':>6}{'cands':>7}{'checked':>9}" \
               f"{'n/a':>6}{'refused':>8}{'bad':>5}"
        rows = [head, "-" * len(head)]
        for r in self.ops:
            rows.append(
                f"{r.name:<16}{r.rule:<16}{r.cases:>6}{r.skipped:>6}{r.candidates:>7}"
                f"{r.strategies:>9}{r.not_applicable:>6}{r.refused:>8}{len(r.mismatches):>5}"
            )
        return "\n".join(rows)


def _check_op(
    info: OpInfo, quick: bool, meshes: Sequence[tuple[int, ...]], seed: int
) -> OpReport:
    rep = OpReport(info.name, info.rule)
    if info.samples not in FAMILIES:
        rep.mismatches.append("no sample calls for this op in the validator")
        return rep
    gen = Gen(seed)
    rng = np.random.default_rng(seed + 1)
    shapes = QUICK_SHAPES if quick else SHAPES
    for case in cases(info, gen, shapes):
        try:
            call = _bind(info, case)
        except _Mismatch as exc:
            rep.mismatches.append(f"{case.label}: global call: {exc}")
            continue
        if call is None:
            rep.skipped += 1
            continue
        rep.cases += 1
        for mesh_shape in meshes:
            current = [None] * len(call.slots)
            try:
                result = rule_result(_schema(call, mesh_shape, current))
            except Exception as exc:  # noqa: BLE001 - reported as a mismatch
                rep.mismatches.append(f"{case.label} mesh {mesh_shape}: rule raised {exc!r}")
                break
            if len(mesh_shape) == 1:
                combos = [(c,) for c in result.candidates if nd_valid(result, (c,))]
                rep.candidates += len(combos)
            else:
                combos = _combos(result, mesh_shape, 12 if quick else None, rng)
            tried = [(combo, None) for combo in combos]
            # the strategies propagate() picks for random input placements
            for _ in range(1 if quick else 3):
                cur = _random_current(call, mesh_shape, rng)
                schema = _schema(call, mesh_shape, cur)
                try:
                    st = propagate(schema, AbstractMesh(mesh_shape), _fake_cost)
                except Exception as exc:  # noqa: BLE001 - reported as a mismatch
                    if info.inplace and "in-place" in str(exc):
                        rep.refused += 1
                        continue
                    rep.mismatches.append(f"{case.label} mesh {mesh_shape}: propagate {exc!r}")
                    continue
                tried.append((st.candidates_considered[-1][0], cur))
            for combo, cur in tried:
                schema = _schema(call, mesh_shape, cur or [None] * len(call.slots))
                try:
                    _run_strategy(call, schema, combo, rng)
                except _NotApplicable:
                    rep.not_applicable += 1
                    continue
                except _Mismatch as exc:
                    pl = " | ".join(
                        ",".join("-" if p is None else p.short() for p in c.placements)
                        for c in combo
                    )
                    rep.mismatches.append(f"{case.label} mesh {mesh_shape} [{pl}]: {exc}")
                    continue
                rep.strategies += 1
    return rep


def validate(
    ops: Sequence[str] | None = None,
    quick: bool = False,
    meshes: Sequence[tuple[int, ...]] = MESHES,
    seed: int = 0,
) -> Report:
    """Check every candidate of the rules of ``ops`` (default: every op). **Local**.

    Parameters
    ----------
    ops : sequence of str, optional
        Op names of the table; default all.
    quick : bool
        Fewer shapes and a sample of the N-D combinations (for CI).
    meshes : sequence of tuple of int
        Mesh shapes to check on.
    seed : int
        Seed of the sample data and of the Partial splits.

    Returns
    -------
    Report
    """
    names = sorted(OPS) if ops is None else list(ops)
    t0 = time.perf_counter()
    reports = []
    state = _random.get_rng_state()
    try:
        # sample data hits 1/0, log(-1)...: inf/nan are compared, not warned about
        with np.errstate(all="ignore"):
            for i, name in enumerate(names):
                reports.append(_check_op(OPS[name], quick, meshes, seed + 7919 * i))
    finally:
        _random.set_rng_state(state)
    return Report(reports, time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m dtensor.validate [--quick] [--op NAME ...]``. **Local**."""
    ap = argparse.ArgumentParser(prog="python -m dtensor.validate", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes, sampled N-D combos")
    ap.add_argument("--op", action="append", help="only this op (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", "-v", action="store_true", help="print every mismatch")
    args = ap.parse_args(argv)
    unknown = [o for o in args.op or () if o not in OPS]
    if unknown:
        ap.error(f"unknown op(s): {', '.join(unknown)}")
    report = validate(args.op, quick=args.quick, seed=args.seed)
    print(report.table())
    for r in report.ops:
        for m in r.mismatches[: None if args.verbose else 3]:
            print(f"MISMATCH {r.name}: {m}")
        if not args.verbose and len(r.mismatches) > 3:
            print(f"MISMATCH {r.name}: ... {len(r.mismatches) - 3} more (use -v)")
    print(report.summary())
    return 1 if report.mismatches else 0
