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

A call whose global kernel raises (an unsupported dtype, say) is skipped. The sample calls,
bound to their op and with their global results, are public (:func:`sample_calls`) for tests
that run them on real meshes. Run
``python -m dtensor.validate [--quick] [--op NAME ...]``: it prints one row per op and a
summary line, and exits non-zero on any mismatch. **Local**: no MPI anywhere.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from placements import Partial, Placement, Replicate, Shard
from placements.layout import local_slices
from placements.rules import ArgMeta, Candidate, OpSchema, OpStrategy, nd_valid, propagate
from placements.rules._core import _rule_result, _strategy

from .local import rng as _random
from .local.tensor import Tensor, _wrap
from .ops import OPS, OpInfo
from .testing import blocks

__all__ = ["Report", "SampleCall", "main", "sample_calls", "validate"]

MESHES: tuple[tuple[int, ...], ...] = ((2,), (3,), (4,), (2, 2))
_R = Replicate()
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_I64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)


class _CoordMesh:
    """A mesh of a given shape seen from one coordinate (what a ``local_fn`` may read), with
    simulated communicators of its mesh dims (``comms``) for kernels that communicate."""

    __slots__ = ("comms", "coord", "shape")

    def __init__(
        self, shape: tuple[int, ...], coord: tuple[int, ...], comms: tuple = ()
    ) -> None:
        self.shape = shape
        self.coord = coord
        self.comms = comms

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def get_coordinate(self) -> tuple[int, ...]:
        return self.coord

    def get_group(self, mesh_dim: int) -> _SimComm:
        return self.comms[mesh_dim]

    def __hash__(self) -> int:
        return hash((self.shape, self.coord))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CoordMesh) and (self.shape, self.coord) == (
            other.shape, other.coord
        )


class _SimGroup:
    """The coordinates of one mesh-dim communicator, run as threads: a barrier and one slot
    per member."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list = [None] * size


_SIM_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


class _SimComm:
    """One coordinate's view of a :class:`_SimGroup`: the all-reduce kernels call."""

    def __init__(self, group: _SimGroup, rank: int) -> None:
        self.group, self.rank = group, rank

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
    """``run(coord, comms)`` for every coordinate: in turn, or (``threads``) at once, one
    thread each, with simulated communicators; the first exception is raised again (a
    failing member aborts the barriers, so that the others do not wait for it)."""
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


# -- sample calls ------------------------------------------------------------------------------
@dataclass
class Case:
    """One sample call: parameter values (numpy arrays stand for tensors) and a label."""

    values: dict[str, object]
    label: str


class _Gen:
    """Deterministic sample data."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def arr(self, shape: tuple[int, ...], dtype: np.dtype, kind: str = "any") -> np.ndarray:
        rng = self.rng
        if dtype == _BOOL:
            return rng.random(shape) < (2.0 if kind == "pos" else 0.5)
        if dtype.kind in "iu":
            lo, hi = {"any": (-4, 5), "pos": (1, 5), "nonneg": (0, 4)}[kind]
            return rng.integers(lo, hi, shape).astype(dtype)
        a = rng.standard_normal(shape)
        if kind == "pos":
            a = np.abs(a) + 0.5
        return a.astype(dtype)


SHAPES = ((8, 12), (5, 7), (3, 2))
QUICK_SHAPES = ((5, 7), (3, 2))
_SCALAR = {_F32: 0.5, _F64: 0.5, _I64: 2, _BOOL: True}


def _dtypes(*kinds: str) -> tuple[np.dtype, ...]:
    table = {"f": _F32, "d": _F64, "i": _I64, "b": _BOOL}
    return tuple(table[k] for k in kinds)


def _unary_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    for shape in shapes:
        for dt in _dtypes("f", "i", "b"):
            v: dict[str, object] = {"input": g.arr(shape, dt)}
            if name == "leaky_relu":
                v["negative_slope"] = 0.1
            yield Case(v, f"{dt.name}{shape}")


def _binary_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    kind = "pos" if name in ("div", "floor_divide", "remainder", "fmod") else "any"
    kind = "nonneg" if name == "pow" else kind
    for shape in shapes:
        r, c = shape
        for dt in _dtypes("f", "i", "b"):
            s = _SCALAR[dt]
            pairs = [
                ((shape, shape), "same"),
                ((shape, (c,)), "bcast"),
                (((r, 1), (1, c)), "outer"),
            ]
            for (sa, sb), tag in pairs:
                yield Case({"input": g.arr(sa, dt), "other": g.arr(sb, dt, kind)},
                           f"{dt.name}{sa}{sb}{tag}")
            yield Case({"input": g.arr(shape, dt), "other": s}, f"{dt.name}{shape}+scalar")
            yield Case({"input": s, "other": g.arr(shape, dt, kind)}, f"scalar+{dt.name}{shape}")
        yield Case({"input": g.arr(shape, _I64), "other": g.arr(shape, _F32, kind)},
                   f"mixed{shape}")
    if name == "div":
        for case in list(_binary_cases(g, shapes[:1], "floor_divide")):
            case.values["rounding_mode"] = "floor"
            yield Case(case.values, case.label + "/floor")


def _ternary_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    for shape in shapes:
        c = shape[-1]
        if name == "where":
            yield Case({"condition": g.arr(shape, _BOOL), "input": g.arr(shape, _F32),
                        "other": g.arr((c,), _F32)}, f"{shape}")
            yield Case({"condition": g.arr((c,), _BOOL), "input": g.arr(shape, _I64),
                        "other": 0}, f"{shape}scalar")
        elif name in ("clamp", "clip"):
            yield Case({"input": g.arr(shape, _F32), "min": -0.5, "max": 0.5}, f"{shape}")
            yield Case({"input": g.arr(shape, _F32), "min": None, "max": 0.3}, f"{shape}hi")
            yield Case({"input": g.arr(shape, _F32), "min": g.arr(shape, _F32) - 1,
                        "max": g.arr((c,), _F32) + 1}, f"{shape}tensors")
            yield Case({"input": g.arr(shape, _I64), "min": -1, "max": 2}, f"{shape}int")
        elif name == "lerp":
            yield Case({"input": g.arr(shape, _F32), "end": g.arr(shape, _F32),
                        "weight": 0.3}, f"{shape}")
            yield Case({"input": g.arr(shape, _F32), "end": g.arr((c,), _F32),
                        "weight": g.arr(shape, _F32)}, f"{shape}tensor-w")
        else:
            kind = "pos" if name == "addcdiv" else "any"
            yield Case({"input": g.arr(shape, _F32), "tensor1": g.arr(shape, _F32),
                        "tensor2": g.arr((c,), _F32, kind)}, f"{shape}")
            yield Case({"input": g.arr((c,), _F32), "tensor1": g.arr(shape, _F32),
                        "tensor2": g.arr(shape, _F32, kind), "value": 2}, f"{shape}v")


_DIMS = (None, 0, 1, (0, 1), -1)


def _reduce_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    shapes = (*shapes, (2, 3, 4))
    dts = _dtypes("f", "i", "b") if name in ("sum", "prod", "amax", "amin", "max", "min",
                                                  "any", "all", "count_nonzero", "argmax",
                                                  "argmin") else _dtypes("f")
    for i, shape in enumerate(shapes):
        for dt in dts:
            for j, dim in enumerate(_DIMS):
                if name in ("logsumexp",) and dim is None:
                    continue
                if name in ("max", "min", "argmax", "argmin") and isinstance(dim, tuple):
                    continue
                keepdim = (i + j) % 2 == 1
                v: dict[str, object] = {"input": g.arr(shape, dt), "dim": dim}
                if name != "count_nonzero":
                    v["keepdim"] = keepdim
                if name == "norm":
                    v["p"] = (2, 1, math.inf, "fro")[j % 4]
                yield Case(v, f"{dt.name}{shape}dim={dim}")


def _scan_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    for shape in shapes:
        for dt in _dtypes("f", "i"):
            for dim in (0, -1):
                yield Case({"input": g.arr(shape, dt), "dim": dim}, f"{dt.name}{shape}dim={dim}")


_PRODUCT_SHAPES = {
    "matmul": (((5, 7), (7, 3)), ((8, 12), (12, 4)), ((7,), (7,)), ((5, 7), (7,)),
               ((7,), (7, 3)), ((2, 5, 7), (7, 3)), ((2, 1, 5, 4), (3, 4, 2))),
    "mm": (((5, 7), (7, 3)), ((8, 12), (12, 4)), ((3, 2), (2, 5))),
    "bmm": (((2, 5, 7), (2, 7, 3)), ((3, 4, 2), (3, 2, 5))),
    "dot": (((7,), (7,)), ((12,), (12,))),
    "outer": (((5,), (7,)), ((8,), (3,))),
}
_EINSUM = (("ij,jk->ik", ((5, 7), (7, 3))), ("bij,bjk->bik", ((2, 5, 7), (2, 7, 3))),
           ("ij->j", ((5, 7),)), ("i,i->", ((7,), (7,))), ("...ij,...jk->...ik",
           ((2, 5, 4), (4, 3))), ("ij,kj", ((5, 7), (3, 7))), ("ii->i", ((4, 4),)))


def _product_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    dts = _dtypes("f", "i")
    if name in _PRODUCT_SHAPES:
        params = OPS[name].params
        for sa, sb in _PRODUCT_SHAPES[name]:
            for dt in dts:
                yield Case({params[0]: g.arr(sa, dt), params[1]: g.arr(sb, dt)},
                           f"{dt.name}{sa}@{sb}")
    elif name == "einsum":
        for eq, ss in _EINSUM:
            yield Case({"equation": eq, "operands": [g.arr(s, _F32) for s in ss]}, eq)
    elif name == "addmm":
        for cs in ((5, 3), (3,), (1, 3)):
            yield Case({"input": g.arr(cs, _F32), "mat1": g.arr((5, 7), _F32),
                        "mat2": g.arr((7, 3), _F32), "beta": 0.5, "alpha": 2.0}, f"bias{cs}")
    elif name == "linear":
        for xs, ws, bs in (((5, 7), (3, 7), (3,)), ((5, 7), (3, 7), None),
                           ((2, 5, 4), (6, 4), (6,)), ((7,), (3, 7), (3,))):
            b = None if bs is None else g.arr(bs, _F32)
            yield Case({"input": g.arr(xs, _F32), "weight": g.arr(ws, _F32), "bias": b},
                       f"{xs}{ws}{bs}")


_VIEW_CASES: dict[str, tuple] = {
    "view": (((8, 12), {"shape": (-1,)}), ((5, 7), {"shape": (35,)}),
             ((3, 2), {"shape": (6,)}), ((12,), {"shape": (3, 4)}),
             ((4, 6), {"shape": (2, 12)}), ((2, 3, 4), {"shape": (6, 4)}),
             ((4, 6), {"shape": (4, 2, 3)}), ((6, 4), {"shape": (4, 6)}),
             ((5, 1, 7), {"shape": (5, 7)})),
    "flatten": (((2, 3, 4), {"start_dim": 0, "end_dim": -1}),
                ((2, 3, 4), {"start_dim": 1, "end_dim": 2}), ((5, 7), {})),
    "unflatten": (((12, 5), {"dim": 0, "sizes": (3, 4)}), ((5, 12), {"dim": 1, "sizes": (-1, 4)}),
                  ((6, 2), {"dim": 0, "sizes": (2, 3)})),
    "permute": (((2, 3, 4), {"dims": (2, 0, 1)}), ((5, 7), {"dims": (1, 0)})),
    "transpose": (((2, 3, 4), {"dim0": 0, "dim1": 2}), ((5, 7), {"dim0": -1, "dim1": 0})),
    "t": (((5, 7), {}), ((7,), {})),
    "movedim": (((2, 3, 4), {"source": 0, "destination": -1}),
                ((2, 3, 4), {"source": (0, 1), "destination": (2, 0)})),
    "squeeze": (((5, 1, 7), {"dim": None}), ((5, 1, 7), {"dim": 1}), ((1, 3), {"dim": None}),
                ((4, 1), {"dim": (0, 1)})),
    "unsqueeze": (((5, 7), {"dim": 0}), ((5, 7), {"dim": -1}), ((5, 7), {"dim": 1})),
    "expand": (((5, 1), {"sizes": (5, 7)}), ((7,), {"sizes": (3, 7)}),
               ((1, 4), {"sizes": (2, 3, -1)})),
    "narrow": (((8, 12), {"dim": 0, "start": 1, "length": 5}),
               ((5, 7), {"dim": 1, "start": -3, "length": 2})),
    "select": (((8, 12), {"dim": 0, "index": 3}), ((5, 7), {"dim": 1, "index": -1})),
    "getitem": (((8, 12), {"idx": 1}), ((5, 7), {"idx": (slice(None), 2)}),
                ((5, 7), {"idx": slice(1, 4)}), ((5, 7), {"idx": (None, Ellipsis, 0)}),
                ((8, 12), {"idx": (slice(None, None, 2), slice(None))}),
                ((2, 3, 4), {"idx": (Ellipsis, slice(0, 10))}),
                # advanced: lists, integer arrays (adjacent or not), bool masks
                ((5, 7), {"idx": [0, 2, 4]}),
                ((5, 7), {"idx": (slice(None), np.array([6, 0, 3]))}),
                ((5, 7), {"idx": np.array([True, False, True, True, False])}),
                ((2, 3, 4), {"idx": (slice(None), np.array([[0, 2], [1, 1]]), slice(None))}),
                ((2, 3, 4), {"idx": (0, slice(None), np.array([3, 1]))}),
                ((3, 2), {"idx": np.array([[True, False], [False, True], [True, True]])}),
                ((5, 7), {"idx": (slice(1, None), np.array([[-1, 2], [0, 0]]))}),
                # several advanced entries broadcasting together (sharded dims masked)
                ((5, 7), {"idx": (np.array([4, 0, -1]), np.array([6, 1, 1]))}),
                ((5, 7), {"idx": (np.array([[0], [3]]), np.array([2, 5, 6]))}),
                ((2, 3, 4), {"idx": (np.array([1, 0]), slice(None), np.array([3, 0]))}),
                ((2, 3, 4), {"idx": (1, np.array([2, 0]), np.array([[3], [1]]))}),
                ((3, 2, 4), {"idx": (np.array([[True, False], [False, False], [True, True]]),
                                     np.array([1, 3, 0]))})),
    "split": (((8, 12), {"split_size_or_sections": 3, "dim": 0}),
              ((5, 7), {"split_size_or_sections": (2, 5), "dim": 1})),
    "chunk": (((8, 12), {"chunks": 3, "dim": 1}), ((5, 7), {"chunks": 2, "dim": 0}),
              ((3, 2), {"chunks": 4, "dim": 0})),
    "unbind": (((3, 5), {"dim": 0}), ((4, 3), {"dim": 1})),
    "flip": (((5, 7), {"dims": (0,)}), ((2, 3, 4), {"dims": (1, 2)})),
    "roll": (((5, 7), {"shifts": 2, "dims": 1}), ((5, 7), {"shifts": 3, "dims": None}),
             ((2, 3, 4), {"shifts": (1, -1), "dims": (0, 2)})),
    "tril": (((5, 7), {"diagonal": 0}), ((2, 4, 4), {"diagonal": 1})),
    "repeat": (((5, 7), {"sizes": (1, 2)}), ((3, 2), {"sizes": (2, 1, 1)})),
    "tile": (((5, 7), {"dims": (2,)}), ((3, 2), {"dims": (2, 1, 1)})),
}
_VIEW_ALIASES = {"reshape": "view", "swapaxes": "transpose", "swapdims": "transpose",
                 "moveaxis": "movedim", "triu": "tril"}


def _view_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    for shape, kw in _VIEW_CASES[_VIEW_ALIASES.get(name, name)]:
        for dt in _dtypes("f", "i"):
            yield Case({"input": g.arr(shape, dt), **kw}, f"{dt.name}{shape}{kw}")


def _join_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    for shape in shapes:
        r, c = shape
        if name == "stack":
            for dim in (0, 1, -1):
                yield Case({"tensors": [g.arr(shape, _F32), g.arr(shape, _F32)], "dim": dim},
                           f"{shape}dim={dim}")
        else:
            yield Case({"tensors": [g.arr(shape, _F32), g.arr((r + 2, c), _F32)], "dim": 0},
                       f"{shape}dim=0")
            yield Case({"tensors": [g.arr(shape, _I64), g.arr((r, 1), _I64),
                                    g.arr((r, c), _F32)], "dim": 1}, f"{shape}dim=1")
    yield Case({"tensors": [g.arr((0,), _F32), g.arr((4, 3), _F32)], "dim": 0}, "legacy-empty")


def _nn_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    if name in ("softmax", "log_softmax"):
        for shape in (*shapes, (2, 3, 4)):
            for dim in (0, -1):
                yield Case({"input": g.arr(shape, _F32), "dim": dim}, f"{shape}dim={dim}")
    elif name == "layer_norm":
        yield Case({"input": g.arr((5, 7), _F32), "normalized_shape": (7,),
                    "weight": g.arr((7,), _F32), "bias": g.arr((7,), _F32)}, "(5,7)")
        yield Case({"input": g.arr((2, 3, 4), _F32), "normalized_shape": (3, 4)}, "(2,3,4)")
    elif name == "embedding":
        for idx_shape, (vocab, d) in (((5,), (10, 6)), ((3, 4), (3, 5)), ((7,), (8, 12))):
            idx = g.rng.integers(0, vocab, idx_shape)
            yield Case({"input": idx, "weight": g.arr((vocab, d), _F32)},
                       f"{idx_shape}->{(vocab, d)}")
    elif name == "cross_entropy":
        for red in ("none", "sum", "mean"):
            t = g.rng.integers(0, 7, (5,))
            t[1] = -100
            yield Case({"input": g.arr((5, 7), _F32), "target": t, "reduction": red}, red)
            yield Case({"input": g.arr((2, 5, 3), _F32), "target": g.rng.integers(0, 5, (2, 3)),
                        "weight": np.abs(g.arr((5,), _F32)), "reduction": red}, f"spatial-{red}")
            p = np.abs(g.arr((4, 6), _F32))
            yield Case({"input": g.arr((4, 6), _F32), "target": p / p.sum(1, keepdims=True),
                        "reduction": red, "label_smoothing": 0.1}, f"probs-{red}")
    elif name == "mse_loss":
        for red in ("none", "sum", "mean"):
            for shape in shapes:
                yield Case({"input": g.arr(shape, _F32), "target": g.arr(shape, _F32),
                            "reduction": red}, f"{shape}{red}")
            yield Case({"input": g.arr((5, 7), _F32), "target": g.arr((7,), _F32),
                        "reduction": red}, f"bcast-{red}")
    elif name == "dropout":
        for shape in shapes:
            for training in (True, False):
                yield Case({"input": g.arr(shape, _F32), "p": 0.3, "training": training},
                           f"{shape}training={training}")


def _cast_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    for shape in shapes:
        for dt in _dtypes("f", "i", "b"):
            v: dict[str, object] = {"input": g.arr(shape, dt)}
            if name == "to":
                for target in (_F64, _I64, _BOOL, _F32):
                    yield Case({**v, "dtype": target}, f"{dt.name}{shape}->{target.name}")
                continue
            if name == "type_as":
                v["other"] = g.arr((2,), _F64)
            yield Case(v, f"{dt.name}{shape}")


def _write_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    for shape in shapes:
        c = shape[-1]
        for dt in _dtypes("f", "i"):
            if name == "copy_":
                yield Case({"input": g.arr(shape, dt), "src": g.arr(shape, dt)}, f"{shape}")
                yield Case({"input": g.arr(shape, dt), "src": g.arr((c,), _F64)}, f"{shape}b")
            elif name == "fill_":
                yield Case({"input": g.arr(shape, dt), "value": _SCALAR[dt]}, f"{shape}")
            else:
                yield Case({"input": g.arr(shape, dt)}, f"{shape}")


_WRITES = ("copy_", "fill_", "zero_")


def _expand_as_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    yield Case({"input": g.arr((5, 1), _F32), "other": g.arr((5, 7), _I64)}, "(5,1)->(5,7)")
    yield Case({"input": g.arr((7,), _F32), "other": g.arr((3, 7), _F32)}, "(7,)->(3,7)")


def _index_cases(g: _Gen, shapes, name: str) -> Iterator[Case]:
    """Indexing ops: indices in range (int64, and int32 for index_select), empty indices,
    sharded and broadcast dims, python-scalar and 0-d values."""
    ints = g.rng.integers
    for shape in shapes:
        r, c = shape
        x = g.arr(shape, _F32)
        if name == "index_select":
            for dim, n in ((0, r), (1, c)):
                yield Case({"input": x, "dim": dim, "index": ints(0, n, (4,))}, f"{shape}d{dim}")
            yield Case({"input": g.arr(shape, _I64), "dim": 1,
                        "index": ints(0, c, (2,)).astype(np.int32)}, f"{shape}int32")
            yield Case({"input": x, "dim": 0, "index": np.zeros((0,), np.int64)}, f"{shape}empty")
        elif name == "gather":
            yield Case({"input": x, "dim": 0, "index": ints(0, r, shape)}, f"{shape}d0")
            yield Case({"input": x, "dim": 1, "index": ints(0, c, (r, 3))}, f"{shape}d1")
            yield Case({"input": x, "dim": 1, "index": ints(0, c, (max(r - 1, 1), c))},
                       f"{shape}d1-short")
        elif name == "take_along_dim":
            yield Case({"input": x, "indices": ints(0, c, (r, 3)), "dim": 1}, f"{shape}d1")
            yield Case({"input": x, "indices": ints(0, r, (2, c)), "dim": 0}, f"{shape}d0")
            yield Case({"input": x, "indices": ints(0, c, (1, 3)), "dim": 1}, f"{shape}bcast")
            yield Case({"input": x, "indices": ints(0, r * c, (4,)), "dim": None}, f"{shape}flat")
        elif name in ("scatter", "scatter_add"):
            yield Case({"input": x, "dim": 0, "index": ints(0, r, shape),
                        "src": g.arr(shape, _F32)}, f"{shape}d0")
            yield Case({"input": x, "dim": 1, "index": ints(0, c, (r, 2)),
                        "src": g.arr((r, 3), _F32)}, f"{shape}d1")
            yield Case({"input": g.arr(shape, _I64), "dim": 1, "index": ints(0, c, (1, c)),
                        "src": g.arr((2, c), _I64)}, f"{shape}int-short")
            if name == "scatter":
                yield Case({"input": x, "dim": 0, "index": ints(0, r, (2, c)), "src": 1.5},
                           f"{shape}scalar")
        elif name == "masked_fill":
            yield Case({"input": x, "mask": g.arr(shape, _BOOL), "value": 0.5}, f"{shape}")
            yield Case({"input": g.arr(shape, _I64), "mask": g.arr((c,), _BOOL), "value": -1},
                       f"{shape}bcast")
            yield Case({"input": x, "mask": g.arr((r, 1), _BOOL),
                        "value": np.array(2.0, np.float32)}, f"{shape}0-d")
        elif name in ("sort", "argsort"):
            for dt in _dtypes("f", "i"):
                for dim, desc in ((0, False), (-1, True)):
                    yield Case({"input": g.arr(shape, dt), "dim": dim, "descending": desc},
                               f"{dt.name}{shape}d{dim}{'desc' if desc else ''}")
        elif name == "topk":
            for dt in _dtypes("f", "i"):
                yield Case({"input": g.arr(shape, dt), "k": min(2, c), "dim": -1},
                           f"{dt.name}{shape}")
                yield Case({"input": g.arr(shape, dt), "k": r - 1, "dim": 0, "largest": False},
                           f"{dt.name}{shape}smallest")
        elif name == "setitem":
            ceil = (c + 1) // 2
            for idx, value in (
                (slice(1, None, 2), 0.5),
                ((slice(None), c - 1), g.arr((r,), _F32)),
                ((slice(1, 4), slice(None)), g.arr((c,), _F32)),
                ((slice(None), slice(0, c, 2)), g.arr((r, ceil), _F32)),
                ((Ellipsis, slice(1, None)), g.arr((r, 1), _F32)),
                (min(1, r - 1), g.arr((c,), _F32)),
                (g.arr(shape, _BOOL), -1.0),
                ([0, r - 1], g.arr((2, c), _F32)),
                ((slice(None), np.array([c - 1, 0])), 2.0),
                ((slice(None), np.array([c - 1, 0])), g.arr((r, 2), _F32)),
                (([0, r - 1, 0], [c - 1, 0, 1]), g.arr((3,), _F32)),
                ((np.array([[r - 1], [0]]), np.array([0, c - 1])), 3.0),
            ):
                yield Case({"input": g.arr(shape, _F32), "idx": idx, "value": value},
                           f"{shape}[{idx!r}]")
        elif name == "index_add":
            for dim, n in ((0, r), (1, c)):
                src = g.arr((4, c) if dim == 0 else (r, 4), _F32)
                yield Case({"input": x, "dim": dim, "index": ints(0, n, (4,)), "source": src},
                           f"{shape}d{dim}")
            yield Case({"input": x, "dim": 0, "index": ints(0, r, (2,)),
                        "source": g.arr((2, c), _F32), "alpha": 2.0}, f"{shape}alpha")
            yield Case({"input": g.arr(shape, _I64), "dim": 1, "index": np.zeros((0,), np.int64),
                        "source": g.arr((r, 0), _I64)}, f"{shape}empty")
        elif name == "index_put":
            for indices, value, acc in (
                ((ints(0, r, (3,)),), g.arr((3, c), _F32), True),
                ((ints(0, r, (4,)), ints(0, c, (4,))), g.arr((4,), _F32), True),
                ((None, np.array([c - 1, 0, c - 1])), g.arr((r, 3), _F32), True),
                ((None, np.array([c - 1, 0])), g.arr((r, 1), _F32), False),
                ((g.arr(shape, _BOOL),), 1.5, True),
                ((np.array([[r - 1], [0]]), np.array([0, c - 1])), g.arr((2, 2), _F32), False),
            ):
                yield Case({"input": g.arr(shape, _F32), "indices": indices, "values": value,
                            "accumulate": acc}, f"{shape}[{len(indices)}]acc={acc}")
        elif name == "kthvalue":
            for dt in _dtypes("f", "i"):
                yield Case({"input": g.arr(shape, dt), "k": 2, "dim": 1}, f"{dt.name}{shape}")
                yield Case({"input": g.arr(shape, dt), "k": r, "dim": 0, "keepdim": True},
                           f"{dt.name}{shape}keepdim")


#: The sample generators, by the ``samples`` family an op record names; each is called with
#: the out-of-place op's name (an in-place op uses its out-of-place one's samples).
_FAMILIES: dict[str, Callable[[_Gen, tuple, str], Iterator[Case]]] = {
    "unary": _unary_cases,
    "binary": _binary_cases,
    "ternary": _ternary_cases,
    "reduce": _reduce_cases,
    "scan": _scan_cases,
    "product": _product_cases,
    "join": _join_cases,
    "nn": _nn_cases,
    "cast": _cast_cases,
    "view": _view_cases,
    "expand_as": _expand_as_cases,
    "write": _write_cases,
    "index": _index_cases,
}


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
            if not np.array_equal(other, val, equal_nan=val.dtype.kind in "fc"):
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
    if want.dtype.kind in "fc":
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
_TOL = {2: 1e-2, 4: 1e-4, 8: 1e-10, 16: 1e-10}


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
        sizes = [w.dtype.itemsize // (2 if w.dtype.kind == "c" else 1) for w in self.want
                 if w.dtype.kind in "fc"]
        for slot in self.slots:
            v = self.arg(slot)
            if isinstance(v, np.ndarray) and v.dtype.kind in "fc":
                sizes.append(v.dtype.itemsize // (2 if v.dtype.kind == "c" else 1))
        return _TOL[min(sizes)] if sizes else 0.0


def _as_kernel_value(v: object) -> object:
    if isinstance(v, np.ndarray):
        return _wrap(_copy(v))
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
        out = info.kernel(*[_as_kernel_value(v) for v in values])
    except Exception:  # noqa: BLE001 - the op does not take these inputs on one device
        return None
    static = tuple((p, values[info.params.index(p)]) for p in info.static_params)
    return SampleCall(info, case.label, values, slots, static, _outputs(out), state)


def _cases(info: OpInfo, gen: _Gen, shapes: tuple) -> Iterator[Case]:
    """The sample cases of ``info``'s family (an in-place op takes its out-of-place op's)."""
    base = info.name[:-1] if info.name.endswith("_") and info.name not in _WRITES else info.name
    return _FAMILIES[info.samples](gen, shapes, base)  # type: ignore[index]


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
    if info.samples not in _FAMILIES:
        return []
    state = _random.get_rng_state()
    try:
        with np.errstate(all="ignore"):
            calls = [_bind(info, case) for case in _cases(info, _Gen(seed), QUICK_SHAPES)]
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
    result = _rule_result(schema)
    n_out = len(result.out_shapes)
    if [r.shape for r in call.want] != list(result.out_shapes):
        raise _Mismatch(f"rule shapes {result.out_shapes} != kernel {[w.shape for w in call.want]}")
    if [w.dtype for w in call.want] != list(result.out_dtypes):
        raise _Mismatch(f"rule dtypes {result.out_dtypes} != kernel {[w.dtype for w in call.want]}")
    # per argument, its target N-D placements (as the dispatcher would move it)
    origin = _CoordMesh(mesh_shape, (0,) * len(mesh_shape))
    targets = list(_strategy(schema, origin, result, combo, 0.0, ()).input_placements)
    layouts = []
    for slot, target in zip(call.slots, targets):
        v = call.arg(slot)
        layouts.append(_layout(v, target, mesh_shape, rng) if isinstance(v, np.ndarray) else None)
    locs: list[dict] = [{} for _ in range(n_out)]

    def run(coord: tuple[int, ...], comms: tuple) -> None:
        mesh = _CoordMesh(mesh_shape, coord, comms)
        strategy: OpStrategy = _strategy(schema, mesh, result, combo, 0.0, ())
        values = list(call.values)
        if info.variadic is not None:
            vi = info.params.index(info.variadic)
            values[vi] = list(values[vi])  # type: ignore[arg-type]
        for slot, target, lay in zip(call.slots, targets, layouts):
            v = call.arg(slot)
            if lay is not None:
                local: object = _wrap(lay[coord])
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
            outs = _outputs(kernel(*values))
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
    if info.samples not in _FAMILIES:
        rep.mismatches.append("no sample calls for this op in the validator")
        return rep
    gen = _Gen(seed)
    rng = np.random.default_rng(seed + 1)
    shapes = QUICK_SHAPES if quick else SHAPES
    for case in _cases(info, gen, shapes):
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
                result = _rule_result(_schema(call, mesh_shape, current))
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
                    st = propagate(schema, _CoordMesh(mesh_shape, (0,) * len(mesh_shape)),
                                   _fake_cost)
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


if __name__ == "__main__":
    sys.exit(main())
