"""The strategy validator's sample calls, by op family: the ``samples`` an op record names
(:attr:`dtensor.ops.OpInfo.samples`) is a key of :data:`FAMILIES`, whose generator yields the
family's cases for one op (even, uneven and empty-shard shapes; float, int and bool dtypes
where meaningful; python scalars; broadcasting), and its edge cases: NaN, inf and -inf
(:meth:`Gen.special`), size-1 and empty dims, negative dims, every defaulted keyword at a
non-default value, integer inputs where torch defines the op (the torch differential suite,
``tests/helpers/torch_ops.py``, checks that each record's samples cover these). The validator
(:mod:`dtensor.debug.validate`) binds them to the op and runs them on simulated meshes; tests
run them on real ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from .table import OPS, OpInfo

__all__ = ["FAMILIES", "INT_CASTS", "QUICK_SHAPES", "SHAPES", "VIEW_CASES", "VIEW_EDGES", "Case",
           "Gen", "cases"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_I64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)


@dataclass
class Case:
    """One sample call: parameter values (numpy arrays stand for tensors) and a label."""

    values: dict[str, object]
    label: str


class Gen:
    """Deterministic sample data (``rng``: the generator, seeded by ``seed``)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def arr(self, shape: tuple[int, ...], dtype: np.dtype, kind: str = "any") -> np.ndarray:
        """A random array: standard normal floats, small ints, fair bools; ``kind``
        ``"pos"`` (positive; bools all True) or ``"nonneg"`` (ints from 0). **Local**."""
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

    def special(self, shape: tuple[int, ...], dtype: np.dtype = _F32) -> np.ndarray:
        """A random float array (:meth:`arr`) holding NaN, inf and -inf: at flat positions
        0, n/3 and 2n/3 (C order, n >= 3 entries), so that a 2-D array of 3+ rows has them
        in different rows and the last row finite. **Local**."""
        a = self.arr(shape, dtype)
        n = a.size
        a.reshape(-1)[[0, n // 3, 2 * n // 3]] = (np.nan, np.inf, -np.inf)
        return a


#: The 2-D shapes of the full run (even and uneven shards, empty ones on meshes of 4), and of
#: the quick one.
SHAPES = ((8, 12), (5, 7), (3, 2))
QUICK_SHAPES = ((5, 7), (3, 2))
_SCALAR = {_F32: 0.5, _F64: 0.5, _I64: 2, _BOOL: True}


def _dtypes(*kinds: str) -> tuple[np.dtype, ...]:
    table = {"f": _F32, "d": _F64, "i": _I64, "b": _BOOL}
    return tuple(table[k] for k in kinds)


#: Unary ops' keyword arguments at a non-default value (given in the float cases of the last
#: shape and the edge cases).
_UNARY_KW: dict[str, dict[str, object]] = {
    "leaky_relu": {"negative_slope": 0.1}, "gelu": {"approximate": "tanh"},
    "round": {"decimals": 1}, "softplus": {"beta": 2.0, "threshold": 1.0},
}


def _unary_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
    for i, shape in enumerate(shapes):
        for dt in _dtypes("f", "i", "b"):
            v: dict[str, object] = {"input": g.arr(shape, dt)}
            if name == "leaky_relu" or (dt == _F32 and i == len(shapes) - 1):
                v.update(_UNARY_KW.get(name, {}))
            yield Case(v, f"{dt.name}{shape}")
    # edges: NaN/inf with a size-1 dim, an empty dim (ints for the ops of ints only)
    kw = _UNARY_KW.get(name, {})
    if name == "bitwise_not":
        yield Case({"input": g.arr((5, 1), _I64)}, "int64(5, 1)")
        yield Case({"input": g.arr((0, 3), _I64)}, "int64(0, 3)")
        return
    yield Case({"input": g.special((5, 1)), **kw}, "float32(5, 1)nan-inf")
    yield Case({"input": g.arr((0, 3), _F32), **kw}, "float32(0, 3)")


def _binary_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
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
                v = {"input": g.arr(sa, dt), "other": g.arr(sb, dt, kind)}
                if name in ("add", "sub") and tag == "bcast" and dt != _BOOL:
                    v["alpha"] = 2  # (torch takes no alpha but a bool one for bools)
                yield Case(v, f"{dt.name}{sa}{sb}{tag}")
            yield Case({"input": g.arr(shape, dt), "other": s}, f"{dt.name}{shape}+scalar")
            yield Case({"input": s, "other": g.arr(shape, dt, kind)}, f"scalar+{dt.name}{shape}")
        yield Case({"input": g.arr(shape, _I64), "other": g.arr(shape, _F32, kind)},
                   f"mixed{shape}")
    # edges: NaN/inf in both operands (a size-1 dim broadcast), an empty dim broadcast
    ints = name.startswith("bitwise")
    alpha = {"alpha": 3} if name in ("add", "sub") else {}
    if not ints:
        other = g.special((4, 1))  # rows 0-2: NaN, inf, -inf
        if kind != "any":
            other[3] = np.abs(other[3]) + 0.5
        x = g.special((4, 3))
        if name == "mul":  # a factor meets non-finite values only in non-finite rows
            x[:3] = other[:3]  # (see "Non-finite values in products" below)
        yield Case({"input": x, "other": other, **alpha}, "nan-inf(4,3)(4,1)")
    dt = _I64 if ints else _F32
    yield Case({"input": g.arr((0, 3), dt), "other": g.arr((1, 3), dt, kind), **alpha},
               f"{dt.name}(0,3)(1,3)")
    if name == "div":
        for case in list(_binary_cases(g, shapes[:1], "floor_divide")):
            case.values["rounding_mode"] = "floor"
            yield Case(case.values, case.label + "/floor")


def _ternary_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
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
    # edges: NaN/inf (a size-1 dim broadcast), an empty dim
    yield from _ternary_edges(g, name)


def _ternary_edges(g: Gen, name: str) -> Iterator[Case]:
    """A case with NaN, inf and -inf in the float operands (not in a factor that may meet a
    Partial one: see the note below), one operand of a size-1 dim broadcast, and one
    with an empty dim (every other keyword at a non-default value)."""
    for shape, small, tag in (((4, 3), (4, 1), "nan-inf"), ((0, 3), (0, 1), "empty")):
        def arr(s: tuple[int, ...], special: bool = tag == "nan-inf") -> np.ndarray:
            return g.special(s) if special else g.arr(s, _F32)

        if name == "where":
            v = {"condition": g.arr(small, _BOOL), "input": arr(shape), "other": arr((3,))}
        elif name in ("clamp", "clip"):
            v = {"input": arr(shape), "min": arr(small) - 1, "max": 0.5}
        elif name == "lerp":
            v = {"input": arr(shape), "end": arr(small), "weight": arr((3,), False)}
        elif name == "addcmul":
            v = {"input": arr(shape), "tensor1": arr(small, False), "tensor2": arr((3,), False),
                 "value": 0.5}
        else:  # addcdiv: a Partial tensor1 divided by an infinity is 0 on every rank
            v = {"input": arr(shape), "tensor1": arr(small), "tensor2": arr((3,)), "value": 0.5}
        yield Case(v, tag)


# Non-finite values in products: the NaN/inf samples keep them away from finite factors. A
# Partial tensor's addends differ in sign from rank to rank, so ``addend * inf`` sums to NaN
# where the global product is +-inf (``0 * inf`` too): linearity, which every rule that keeps
# a Partial through a product relies on (PyTorch's DTensor's too), holds for finite values
# only (the README says so). mul's non-finite rows meet non-finite rows only; addcmul's
# factors and lerp's weight are finite (their other operands are added, which is exact).


_DIMS = (None, 0, 1, (0, 1), -1)


def _reduce_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
    shapes = (*shapes, (2, 3, 4))
    dts = _dtypes("f", "i", "b") if name in ("sum", "prod", "amax", "amin", "max", "min",
                                                  "any", "all", "count_nonzero", "argmax",
                                                  "argmin") else _dtypes(
        "f", "i") if name == "logsumexp" else _dtypes("f")
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
                if name in ("std", "var") and j in (1, 2):  # (torch takes one of the two)
                    v["unbiased" if j == 1 else "correction"] = (False, 2)[j - 1]
                yield Case(v, f"{dt.name}{shape}dim={dim}")
    # edges: NaN, inf and -inf in different rows of a size-1 dim (one row finite), an empty
    # dim; in float32 with a float64 result where the op takes a dtype
    for x, dim, keepdim in ((g.special((4, 1, 3)), -1, True), (g.arr((0, 3), _F32), -1, False)):
        v = {"input": x, "dim": dim}
        if name != "count_nonzero":
            v["keepdim"] = keepdim
        if "dtype" in OPS[name].params:
            v["dtype"] = _F64
        yield Case(v, f"float32{x.shape}dim={dim}{'nan-inf' if x.size else ''}")


def _scan_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
    for shape in shapes:
        for dt in _dtypes("f", "i"):
            for dim in (0, -1):
                yield Case({"input": g.arr(shape, dt), "dim": dim}, f"{dt.name}{shape}dim={dim}")
    # edges: NaN/inf along a size-1 dim's rows (a float64 result), an empty dim
    yield Case({"input": g.special((4, 1, 3)), "dim": -1, "dtype": _F64}, "nan-inf(4,1,3)f64")
    yield Case({"input": g.arr((0, 3), _I64), "dim": 0, "dtype": _F32}, "int64(0,3)f32")


_PRODUCT_SHAPES = {
    "matmul": (((5, 7), (7, 3)), ((8, 12), (12, 4)), ((7,), (7,)), ((5, 7), (7,)),
               ((7,), (7, 3)), ((2, 5, 7), (7, 3)), ((2, 1, 5, 4), (3, 4, 2))),
    "mm": (((5, 7), (7, 3)), ((8, 12), (12, 4)), ((3, 2), (2, 5))),
    "bmm": (((2, 5, 7), (2, 7, 3)), ((3, 4, 2), (3, 2, 5))),
    "dot": (((7,), (7,)), ((12,), (12,))),
    "outer": (((5,), (7,)), ((8,), (3,))),
}
#: Edge cases of the products above, in float32: a size-1 dim (with data) and an empty one.
_PRODUCT_EDGES = {
    "matmul": (((0, 4), (4, 3)),),
    "mm": (((5, 1), (1, 3)), ((0, 4), (4, 3))),
    "bmm": (((1, 4, 1), (1, 1, 3)), ((2, 0, 3), (2, 3, 4))),
    "dot": (((1,), (1,)), ((0,), (0,))),
    "outer": (((1,), (4,)), ((0,), (3,))),
}
_EINSUM = (("ij,jk->ik", ((5, 7), (7, 3))), ("bij,bjk->bik", ((2, 5, 7), (2, 7, 3))),
           ("ij->j", ((5, 7),)), ("i,i->", ((7,), (7,))), ("...ij,...jk->...ik",
           ((2, 5, 4), (4, 3))), ("ij,kj", ((5, 7), (3, 7))), ("ii->i", ((4, 4),)))


def _product_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
    dts = _dtypes("f", "i")
    if name in _PRODUCT_SHAPES:
        params = OPS[name].params
        for sa, sb in _PRODUCT_SHAPES[name]:
            for dt in dts:
                yield Case({params[0]: g.arr(sa, dt), params[1]: g.arr(sb, dt)},
                           f"{dt.name}{sa}@{sb}")
        for sa, sb in _PRODUCT_EDGES[name]:
            yield Case({params[0]: g.arr(sa, _F32), params[1]: g.arr(sb, _F32)},
                       f"float32{sa}@{sb}")
    elif name == "einsum":
        for eq, ss in _EINSUM:
            yield Case({"equation": eq, "operands": [g.arr(s, _F32) for s in ss]}, eq)
        yield Case({"equation": "ij,jk->ik", "operands": [g.arr((5, 1), _I64),
                                                          g.arr((1, 3), _I64)]}, "int64(5,1)")
        yield Case({"equation": "ij,jk->ik", "operands": [g.arr((0, 4), _F32),
                                                          g.arr((4, 3), _F32)]}, "(0,4)")
    elif name == "addmm":
        for cs in ((5, 3), (3,), (1, 3)):
            yield Case({"input": g.arr(cs, _F32), "mat1": g.arr((5, 7), _F32),
                        "mat2": g.arr((7, 3), _F32), "beta": 0.5, "alpha": 2.0}, f"bias{cs}")
        yield Case({"input": g.arr((3,), _I64), "mat1": g.arr((5, 4), _I64),
                    "mat2": g.arr((4, 3), _I64), "beta": 2, "alpha": 3}, "int64")
        yield Case({"input": g.arr((5, 3), _F32), "mat1": g.arr((5, 0), _F32),
                    "mat2": g.arr((0, 3), _F32), "beta": 0.5}, "empty-contraction")
    elif name == "linear":
        for xs, ws, bs, dt in (((5, 7), (3, 7), (3,), _F32), ((5, 7), (3, 7), None, _F32),
                               ((2, 5, 4), (6, 4), (6,), _F32), ((7,), (3, 7), (3,), _F32),
                               ((5, 4), (3, 4), (3,), _I64), ((0, 4), (1, 4), (1,), _F32)):
            b = None if bs is None else g.arr(bs, dt)
            yield Case({"input": g.arr(xs, dt), "weight": g.arr(ws, dt), "bias": b},
                       f"{dt.name}{xs}{ws}{bs}")


#: The view family's cases, by op: ``(input shape, the other arguments)``.
VIEW_CASES: dict[str, tuple] = {
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
#: Each view op's edge cases, run in float32 only: a size-1 dim (with data) and an empty dim
#: (negative dims among them).
VIEW_EDGES: dict[str, tuple] = {
    "view": (((0, 6), {"shape": (2, 0, 3)}),),
    "flatten": (((3, 1, 4), {"start_dim": -2}), ((2, 0, 3), {"start_dim": 1})),
    "unflatten": (((1, 6), {"dim": -1, "sizes": (2, 3)}), ((0, 6), {"dim": -1, "sizes": (3, 2)})),
    "permute": (((3, 1, 4), {"dims": (2, 0, 1)}), ((0, 3, 2), {"dims": (1, -1, 0)})),
    "transpose": (((4, 1, 3), {"dim0": 1, "dim1": -1}), ((0, 3), {"dim0": 0, "dim1": 1})),
    "t": (((1, 5), {}), ((0, 3), {})),
    "movedim": (((3, 1, 4), {"source": -1, "destination": 0}),
                ((0, 2, 3), {"source": 0, "destination": 2})),
    "squeeze": (((0, 1, 3), {"dim": -2}),),
    "unsqueeze": (((4, 1), {"dim": 1}), ((0, 3), {"dim": 0})),
    "expand": (((0, 1), {"sizes": (2, 0, 3)}),),
    "narrow": (((4, 1, 3), {"dim": -1, "start": 1, "length": 2}),
               ((0, 5), {"dim": -1, "start": 2, "length": 3})),
    "select": (((4, 1, 3), {"dim": -2, "index": 0}), ((0, 4), {"dim": -1, "index": 2})),
    "getitem": (((4, 1, 3), {"idx": (Ellipsis, 0, slice(1, None))}),
                ((0, 5), {"idx": (slice(None), np.array([4, 0]))})),
    "split": (((4, 1, 5), {"split_size_or_sections": 2, "dim": -1}),
              ((0, 5), {"split_size_or_sections": (2, 3), "dim": -1})),
    "chunk": (((1, 7), {"chunks": 3, "dim": -1}), ((0, 4), {"chunks": 2, "dim": 1})),
    "unbind": (((4, 1, 3), {"dim": -1}), ((0, 3), {"dim": -1})),
    "flip": (((4, 1, 3), {"dims": (-1, 1)}), ((0, 3), {"dims": (0,)})),
    "roll": (((4, 1, 3), {"shifts": (1, 2), "dims": (0, -1)}), ((0, 3), {"shifts": 1, "dims": 1})),
    "tril": (((4, 1, 3), {"diagonal": 0}), ((0, 3), {"diagonal": 1})),
    "repeat": (((4, 1), {"sizes": (1, 3)}), ((0, 2), {"sizes": (2, 2)})),
    "tile": (((4, 1), {"dims": (1, 3)}), ((0, 2), {"dims": (2,)})),
}
_VIEW_ALIASES = {"reshape": "view", "swapaxes": "transpose", "swapdims": "transpose",
                 "moveaxis": "movedim", "triu": "tril"}


def _view_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
    for shape, kw in VIEW_CASES[_VIEW_ALIASES.get(name, name)]:
        for dt in _dtypes("f", "i"):
            yield Case({"input": g.arr(shape, dt), **kw}, f"{dt.name}{shape}{kw}")
    for shape, kw in VIEW_EDGES.get(_VIEW_ALIASES.get(name, name), ()):
        yield Case({"input": g.arr(shape, _F32), **kw}, f"float32{shape}{kw}")


def _join_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
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
    # edges: negative dims, size-1 and empty dims, ints
    if name == "stack":
        yield Case({"tensors": [g.arr((1, 3), _I64), g.arr((1, 3), _I64)], "dim": -1},
                   "int64(1,3)dim=-1")
        yield Case({"tensors": [g.arr((0, 3), _F32), g.arr((0, 3), _F32)], "dim": 1},
                   "(0,3)dim=1")
        return
    yield Case({"tensors": [g.arr((4, 1), _F32), g.arr((4, 2), _I64)], "dim": -1},
               "(4,1)(4,2)dim=-1")
    yield Case({"tensors": [g.arr((0,), _F32), g.arr((4, 3), _F32)], "dim": 0}, "legacy-empty")


def _nn_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
    if name in ("softmax", "log_softmax"):
        for shape in (*shapes, (2, 3, 4)):
            for dim in (0, -1):
                yield Case({"input": g.arr(shape, _F32), "dim": dim}, f"{shape}dim={dim}")
    elif name == "layer_norm":
        yield Case({"input": g.arr((5, 7), _F32), "normalized_shape": (7,),
                    "weight": g.arr((7,), _F32), "bias": g.arr((7,), _F32)}, "(5,7)")
        yield Case({"input": g.arr((2, 3, 4), _F32), "normalized_shape": (3, 4)}, "(2,3,4)")
    elif name == "_layer_norm_backward":
        yield Case({"grad": g.arr((5, 7), _F32), "input": g.arr((5, 7), _F32),
                    "normalized_shape": (7,), "weight": g.arr((7,), _F32)}, "(5,7)")
        yield Case({"grad": g.arr((2, 3, 4), _F32), "input": g.arr((2, 3, 4), _F32),
                    "normalized_shape": (3, 4)}, "(2,3,4)")
    elif name == "_gelu_backward":
        for shape in shapes:
            for approximate in ("none", "tanh"):
                yield Case({"grad": g.arr(shape, _F32), "input": g.arr(shape, _F32),
                            "approximate": approximate}, f"{shape}{approximate}")
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
    elif name == "rms_norm":
        yield Case({"input": g.arr((5, 7), _F32), "normalized_shape": (7,),
                    "weight": g.arr((7,), _F32)}, "(5,7)")
        yield Case({"input": g.arr((2, 3, 4), _F32), "normalized_shape": (3, 4), "eps": 1e-3},
                   "(2,3,4)eps")
        yield Case({"input": g.arr((3, 5, 2), _F64), "normalized_shape": 2,
                    "weight": g.arr((2,), _F64)}, "f64(3,5,2)")
    elif name == "scaled_dot_product_attention":
        yield from _attention_cases(g)
    elif name == "scaled_dot_product_attention_backward":
        yield from _attention_backward_cases(g)
    yield from _nn_edges(g, name)


def _nn_edges(g: Gen, name: str) -> Iterator[Case]:
    """Per nn op, a case with a size-1 dim (NaN/inf and a float64 result for softmax, the
    keywords the other cases leave at their default) and one with an empty dim."""
    a = g.arr
    if name in ("softmax", "log_softmax"):
        yield Case({"input": g.special((4, 1, 3)), "dim": -1, "dtype": _F64}, "nan-inf(4,1,3)")
        yield Case({"input": a((0, 3), _F32), "dim": -1}, "(0,3)")
    elif name == "layer_norm":
        yield Case({"input": a((4, 1, 3), _F32), "normalized_shape": (1, 3),
                    "weight": a((1, 3), _F32), "bias": a((1, 3), _F32), "eps": 1e-3}, "(4,1,3)")
        yield Case({"input": a((0, 3), _F32), "normalized_shape": (3,), "eps": 0.1}, "(0,3)")
    elif name == "_layer_norm_backward":
        yield Case({"grad": a((4, 1, 3), _F32), "input": a((4, 1, 3), _F32),
                    "normalized_shape": (1, 3), "weight": a((1, 3), _F32), "eps": 1e-3},
                   "(4,1,3)")
        yield Case({"grad": a((0, 3), _F32), "input": a((0, 3), _F32),
                    "normalized_shape": (3,), "eps": 0.1}, "(0,3)")
    elif name == "rms_norm":
        yield Case({"input": a((4, 1, 3), _F32), "normalized_shape": (1, 3),
                    "weight": a((1, 3), _F32)}, "(4,1,3)")
        yield Case({"input": a((0, 3), _F32), "normalized_shape": (3,), "eps": 0.1}, "(0,3)")
    elif name == "_gelu_backward":
        yield Case({"grad": a((4, 1), _F32), "input": a((4, 1), _F32), "approximate": "tanh"},
                   "(4,1)")
        yield Case({"grad": a((0, 3), _F32), "input": a((0, 3), _F32)}, "(0,3)")
    elif name == "cross_entropy":  # (N=1, C=5, d=3), the ignored class among the targets
        t = g.rng.integers(0, 5, (1, 3))
        t[0, 1] = 2
        yield Case({"input": a((1, 5, 3), _F32), "target": t, "ignore_index": 2}, "ignore")
        yield Case({"input": a((0, 5), _F32), "target": np.zeros((0,), np.int64),
                    "reduction": "sum"}, "(0,5)")
    elif name == "mse_loss":
        yield Case({"input": a((4, 1), _F32), "target": a((4, 1), _F32)}, "(4,1)")
        yield Case({"input": a((0, 3), _F32), "target": a((0, 3), _F32), "reduction": "sum"},
                   "(0,3)")
    elif name == "dropout":
        yield Case({"input": a((4, 1), _F32), "p": 0.5}, "(4,1)")
        yield Case({"input": a((0, 3), _F32), "p": 0.2}, "(0,3)")
    elif name == "embedding":  # the padding row among the indices: no gradient (by
        # definition, not the derivative: the last case, past finite differences' first four)
        yield Case({"input": np.zeros((0,), np.int64), "weight": a((4, 3), _F32)}, "(0,)")
        yield Case({"input": np.array([[1, 3, 1], [0, 4, 2]]), "weight": a((5, 1), _F32),
                    "padding_idx": 1}, "padding(5,1)")
    elif name == "scaled_dot_product_attention":
        yield Case({"query": a((0, 3, 4, 2), _F32), "key": a((0, 3, 5, 2), _F32),
                    "value": a((0, 3, 5, 3), _F32)}, "empty-batch")
    elif name == "scaled_dot_product_attention_backward":
        yield Case({"grad": a((0, 3, 4, 3), _F32), "query": a((0, 3, 4, 2), _F32),
                    "key": a((0, 3, 5, 2), _F32), "value": a((0, 3, 5, 3), _F32)},
                   "empty-batch")


def _attention_cases(g: Gen) -> Iterator[Case]:
    """Batch and head dims (uneven and smaller than the mesh), L != S, boolean and float
    masks (broadcast, a row without any key), causal with L > S and L < S, scale, dropout,
    grouped-query heads, broadcast batch dims and plain 2-D calls."""

    def qkv(batch, n_q, n_k, e=4, ev=3, heads=None, dt=_F32):
        kv = batch if heads is None else (*batch[:-1], heads)
        return {"query": g.arr((*batch, n_q, e), dt), "key": g.arr((*kv, n_k, e), dt),
                "value": g.arr((*kv, n_k, ev), dt)}

    mask = g.arr((5, 6), _BOOL)
    mask[2] = False  # query 2 attends to no key: zeros
    yield Case({**qkv((2, 3), 5, 6), "attn_mask": mask, "scale": 0.3}, "bool-mask(5,6)")
    yield Case({**qkv((3, 2), 5, 5), "is_causal": True}, "causal")
    yield Case({**qkv((2, 3), 5, 6), "attn_mask": g.arr((2, 1, 5, 6), _F32)},
               "float-mask(2,1,5,6)")
    yield Case({**qkv((2,), 7, 4, dt=_F64), "is_causal": True, "scale": 0.7}, "f64-causal-L>S")
    yield Case(qkv((5,), 3, 6, e=2), "L<S")
    yield Case({**qkv((2, 3), 6, 5), "is_causal": True, "dropout_p": 0.3}, "causal-dropout")
    yield Case({**qkv((2, 4), 5, 6, heads=2), "is_causal": True, "enable_gqa": True}, "gqa")
    yield Case({**qkv((1, 3), 5, 6), "key": g.arr((2, 1, 6, 4), _F32),
                "attn_mask": g.arr((1, 6), _BOOL) | True}, "broadcast-batch")
    yield Case(qkv((), 6, 5), "2-D")


def _attention_backward_cases(g: Gen) -> Iterator[Case]:
    """Causal and not, L != S (causal with L > S and L < S), scale, float64, grouped-query
    heads, a single query, plain 2-D calls."""

    def args(batch, n_q, n_k, e=4, ev=3, heads=None, dt=_F32):
        kv = batch if heads is None else (*batch[:-1], heads)
        return {"grad": g.arr((*batch, n_q, ev), dt), "query": g.arr((*batch, n_q, e), dt),
                "key": g.arr((*kv, n_k, e), dt), "value": g.arr((*kv, n_k, ev), dt)}

    yield Case({**args((3, 2), 5, 5), "is_causal": True}, "causal")
    yield Case({**args((2, 3), 5, 6), "scale": 0.3}, "L<S")
    yield Case({**args((2,), 7, 4, dt=_F64), "is_causal": True, "scale": 0.7}, "f64-causal-L>S")
    yield Case({**args((2, 3), 4, 6), "is_causal": True}, "causal-L<S")
    yield Case({**args((2, 4), 5, 6, heads=2), "is_causal": True, "enable_gqa": True}, "gqa")
    yield Case({**args((3,), 1, 1), "is_causal": True}, "one")
    yield Case(args((), 6, 5), "2-D")


def _cast_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
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
    # edges: a size-1 dim with NaN/inf (finite for a cast to an integer type: undefined for
    # non-finite values), an empty dim
    nonfinite = name not in INT_CASTS
    x = g.special((5, 1)) if nonfinite else g.arr((5, 1), _F32)
    kw: dict[str, object] = {"other": g.arr((2,), _F64)} if name == "type_as" else {}
    if name == "to":
        kw = {"dtype": _F64}
    yield Case({"input": x, **kw}, "float32(5, 1)" + ("nan-inf" if nonfinite else ""))
    if name == "to":
        kw = {"dtype": _BOOL}
    yield Case({"input": g.arr((0, 3), _F32), **kw}, "float32(0, 3)")


def _write_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
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
    # edges: a size-1 dim (a broadcast source), an empty dim
    for shape, src in (((4, 1), (1,)), ((0, 3), (3,))):
        v: dict[str, object] = {"input": g.arr(shape, _F32)}
        if name == "copy_":
            v["src"] = g.arr(src, _I64)
        elif name == "fill_":
            v["value"] = -1.5
        yield Case(v, f"float32{shape}")


_WRITES = ("copy_", "fill_", "zero_")
#: The casts to an integer dtype: undefined for NaN and inf (C's conversion; torch documents
#: the result as undefined), so their samples hold finite floats only.
INT_CASTS = frozenset(("byte", "char", "short", "int", "long"))


def _expand_as_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
    yield Case({"input": g.arr((5, 1), _F32), "other": g.arr((5, 7), _I64)}, "(5,1)->(5,7)")
    yield Case({"input": g.arr((7,), _F32), "other": g.arr((3, 7), _F32)}, "(7,)->(3,7)")
    yield Case({"input": g.arr((1, 3), _F32), "other": g.arr((0, 3), _F32)}, "(1,3)->(0,3)")


def _index_cases(g: Gen, shapes, name: str) -> Iterator[Case]:
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
    yield from _index_edges(g, name)


def _index_edges(g: Gen, name: str) -> Iterator[Case]:
    """Per indexing op, a case with a negative dim and a size-1 dim (ints, or the keyword
    the other cases leave at its default) and one with an empty dim."""
    ints = g.rng.integers
    x, empty = g.arr((4, 1, 3), _F32), g.arr((0, 3), _F32)
    if name in ("sort", "argsort"):  # stable: ties (ints) keep their order, as in torch
        yield Case({"input": g.arr((1, 7), _I64), "dim": -1, "descending": True,
                    "stable": True}, "int64(1,7)stable")
        yield Case({"input": empty, "dim": 0, "stable": True}, "(0,3)")
    elif name == "topk":
        yield Case({"input": x, "k": 2, "dim": -1, "largest": False, "sorted": False},
                   "(4,1,3)unsorted")
        yield Case({"input": empty, "k": 2, "dim": -1}, "(0,3)")
    elif name == "kthvalue":
        yield Case({"input": x, "k": 1, "dim": -2}, "(4,1,3)d-2")
        yield Case({"input": empty, "k": 3, "dim": -1, "keepdim": True}, "(0,3)")
    elif name == "gather":
        yield Case({"input": x, "dim": -1, "index": ints(0, 3, (4, 1, 2))}, "(4,1,3)d-1")
        yield Case({"input": empty, "dim": -1, "index": ints(0, 3, (0, 2))}, "(0,3)")
    elif name == "take_along_dim":
        yield Case({"input": x, "indices": ints(0, 3, (4, 1, 2)), "dim": -1}, "(4,1,3)d-1")
        yield Case({"input": empty, "indices": ints(0, 3, (0, 1)), "dim": -1}, "(0,3)")
    elif name in ("scatter", "scatter_add"):
        yield Case({"input": x, "dim": -1, "index": ints(0, 3, (4, 1, 2)),
                    "src": g.arr((4, 1, 3), _F32)}, "(4,1,3)d-1")
        yield Case({"input": empty, "dim": -1, "index": ints(0, 3, (0, 2)),
                    "src": g.arr((0, 2), _F32)}, "(0,3)")
    elif name == "index_select":
        yield Case({"input": x, "dim": -1, "index": np.array([2, 0, 2])}, "(4,1,3)d-1")
    elif name == "index_add":
        yield Case({"input": x, "dim": -1, "index": np.array([2, 0, 2]),
                    "source": g.arr((4, 1, 3), _F32), "alpha": -1.5}, "(4,1,3)d-1")
    elif name == "index_put":
        yield Case({"input": g.arr((4, 3), _I64), "indices": (np.array([3, 0, 3]),),
                    "values": g.arr((1, 3), _I64), "accumulate": True}, "int64")
        yield Case({"input": empty, "indices": (None, np.array([2, 0])),
                    "values": g.arr((2,), _F32)}, "(0,3)")
    elif name == "setitem":
        yield Case({"input": g.arr((4, 3), _I64), "idx": (slice(None), np.array([2, 0])),
                    "value": g.arr((4, 1), _I64)}, "int64")
        yield Case({"input": empty, "idx": (Ellipsis, 1), "value": 2.0}, "(0,3)")
    elif name == "masked_fill":
        yield Case({"input": empty, "mask": g.arr((3,), _BOOL), "value": 1.5}, "(0,3)")


#: The sample generators, by the ``samples`` family an op record names; each is called with
#: the out-of-place op's name (an in-place op uses its out-of-place one's samples).
FAMILIES: dict[str, Callable[[Gen, tuple, str], Iterator[Case]]] = {
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


def cases(info: OpInfo, gen: Gen, shapes: tuple) -> Iterator[Case]:
    """The sample cases of ``info``'s family (an in-place op takes its out-of-place op's), of
    ``shapes`` (:data:`SHAPES` or :data:`QUICK_SHAPES`, where the family draws them from the
    shapes) with data from ``gen``. **Local**.

    Raises
    ------
    KeyError
        When ``info`` names no sample family (:data:`FAMILIES`).
    """
    base = info.name[:-1] if info.name.endswith("_") and info.name not in _WRITES else info.name
    return FAMILIES[info.samples](gen, shapes, base)  # type: ignore[index]
