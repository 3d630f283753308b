"""Records of the products: ``matmul`` (and ``@``), ``mm``, ``bmm``, ``dot``, ``outer``,
``addmm``, ``linear`` and ``einsum``, with their backward formulas."""

from __future__ import annotations

import string

from ..local import kernels as K
from ._grad import arange, scaled
from .table import Backward, Operator, declare

__all__: list[str] = []


def _matmul(g, v, o, need, fns):
    a, b = v[0], v[1]
    if a.ndim == 1 and b.ndim == 1:
        return (g * b if need[0] else None, g * a if need[1] else None)
    a1 = a.unsqueeze(0) if a.ndim == 1 else a
    b1 = b.unsqueeze(-1) if b.ndim == 1 else b
    g1 = g.unsqueeze(-2) if a.ndim == 1 else g
    g1 = g1.unsqueeze(-1) if b.ndim == 1 else g1
    ga = gb = None
    if need[0]:
        ga = g1 @ b1.mT
        ga = ga.squeeze(-2) if a.ndim == 1 else ga
    if need[1]:
        gb = a1.mT @ g1
        gb = gb.squeeze(-1) if b.ndim == 1 else gb
    return (ga, gb)


def _outer(g, v, o, need, fns):
    a, b = v[0], v[1]
    return (g @ b if need[0] else None, a @ g if need[1] else None)


def _addmm(g, v, o, need, fns):
    m1, m2, beta, alpha = v[1], v[2], v[3], v[4]
    return (
        scaled(g, beta) if need[0] else None,
        scaled(g @ m2.mT, alpha) if need[1] else None,
        scaled(m1.mT @ g, alpha) if need[2] else None,
    )


def _linear(g, v, o, need, fns):
    x, w = v[0], v[1]
    gx = g @ w if need[0] else None
    gw = None
    if need[1]:
        g2 = g.reshape(-1, w.shape[0])
        x2 = x.reshape(-1, w.shape[1])
        gw = g2.mT @ x2
    return (gx, gw, g if need[2] else None)


def _einsum_letters(equation, ndims):
    """``equation``'s terms and output with ``...`` spelled out in fresh letters (right
    aligned, as numpy broadcasts them) and the implicit output made explicit; and an
    iterator of further unused letters."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    fresh = (c for c in string.ascii_letters if c not in eq)
    spans = [nd - (len(t) - 3) if "..." in t else 0 for t, nd in zip(terms, ndims)]
    ell = "".join(next(fresh) for _ in range(max(spans, default=0)))
    terms = [t.replace("...", ell[len(ell) - k:]) if "..." in t else t
             for t, k in zip(terms, spans)]
    if arrow:
        rhs = rhs.replace("...", ell)
    else:  # the broadcast dims, then the letters that occur once, sorted
        rhs = ell + "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
    return terms, rhs, fresh


def _eye(n, like, fns):
    """The ``n`` x ``n`` identity in ``like``'s dtype (on its mesh, Replicate)."""
    ar = arange(n, like, fns)
    return (ar.unsqueeze(-1) == ar).to(like.dtype)


def _einsum(g, v, o, need, fns):
    equation, operands = v[0], list(v[1])
    terms, rhs, fresh = _einsum_letters(equation, [x.ndim for x in operands])
    out = []
    for i, (term, x) in enumerate(zip(terms, operands)):
        if not need[i]:
            out.append(None)
            continue
        others = [t for j, t in enumerate(terms) if j != i]
        avail = set(rhs).union(*others)
        uniq = "".join(dict.fromkeys(term))  # a repeated letter once (its diagonal)
        sizes = {c: x.shape[p] for p, c in enumerate(term)}
        spec = ",".join([rhs, *others]) + "->" + "".join(c for c in uniq if c in avail)
        gi = fns.einsum(spec, g, *[operands[j] for j in range(len(terms)) if j != i])
        for pos, c in enumerate(uniq):
            if c not in avail:  # summed by the forward: every element gets the gradient
                gi = gi.unsqueeze(pos)
            elif sizes[c] == 1 and gi.shape[pos] != 1:  # broadcast by the forward
                gi = gi.sum(dim=pos, keepdim=True)
        gi = gi.expand(tuple(sizes[c] for c in uniq))
        if uniq != term:  # put the gradient on the diagonal of each repeated letter
            seen, full, eyes = set(), "", []
            for c in term:
                if c in seen:
                    f = next(fresh)
                    eyes.append(c + f)
                    full += f
                else:
                    seen.add(c)
                    full += c
            spec = ",".join([uniq, *eyes]) + "->" + full
            gi = fns.einsum(spec, gi, *[_eye(sizes[e[0]], g, fns) for e in eyes])
        out.append(gi)
    return tuple(out)


def product(name: str, tensors: tuple[str, ...], backward: Backward, **kw: object) -> None:
    """Declare the product ``name`` over its kernel in :mod:`dtensor.local.kernels`, with
    its formula ``backward`` (compute class ``matmul``). **Local**."""
    declare(name, getattr(K, name), tensors, samples="product", backward=backward,
            cost="matmul", **kw)


product("matmul", ("input", "other"), Backward(_matmul, ("input", "other")), raw="matmul",
        operators=(
    Operator("__matmul__", "binary", K.matmul_operator(False)),
    Operator("__rmatmul__", "reflected", K.matmul_operator(True)),
))
product("mm", ("input", "mat2"), Backward(_matmul, ("input", "mat2")), raw="matmul")
product("bmm", ("input", "mat2"), Backward(_matmul, ("input", "mat2")))
product("dot", ("input", "other"), Backward(_matmul, ("input", "other")))
product("outer", ("input", "vec2"), Backward(_outer, ("input", "vec2")))
product("addmm", ("input", "mat1", "mat2"), Backward(_addmm, ("mat1", "mat2")))
product("linear", ("input", "weight", "bias"), Backward(_linear, ("input", "weight")),
        method=False)
product("einsum", ("operands",), Backward(_einsum, ("operands",)), variadic="operands",
        method=False)
