"""Sharding rules of products: matmul, mm, bmm, dot, outer, addmm, linear and einsum.

Every product is first written as an einsum equation over explicit letters (``matmul``
with its 1-D and broadcast batch cases, ``linear`` as ``...i,oi->...o``...) and ONE rule
(:func:`einsum_result`) derives the candidates:

- all-Replicate;
- every output letter (batch or free dim): Shard of that dim on the output and on every
  operand that has the letter at full size (an operand that broadcasts it is Replicate);
- every contracted letter: Shard of it on every operand that has it gives ``P(sum)``;
- linearity: ``P(sum)`` (or ``P(avg)``) on one operand, Replicate on the others, gives
  ``P(sum)`` (``P(avg)``).

An added term (``addmm``'s ``input``, ``linear``'s ``bias``) follows the output: sharded
like the output dims it has, Partial when the output is Partial (a replicated bias is then
split so that it is added once).

Before that, :func:`check_sizes` compares the operands' GLOBAL sizes letter by letter: a
mismatch is a ShardingError naming the op and the global shapes (the dispatcher adds the
placements), raised identically on every rank before any redistribution or local kernel.
"""

from __future__ import annotations

import string

from ..errors import ShardingError
from ..meta import broadcast_shapes, result_dtype
from ._core import ArgMeta, Candidate, OpSchema, P, R, RuleResult, S, register_rule

__all__ = ["check_sizes", "einsum_result", "parse_einsum", "product_rule"]


def parse_einsum(equation: str, ndims: list[int]) -> tuple[list[str], str]:
    """Explicit subscripts of an einsum equation: one per operand, and the output's.

    ``...`` becomes letters unused by the equation (right-aligned across operands, as
    broadcasting); an implicit output is the ellipsis letters followed by the letters that
    appear once, sorted (numpy/PyTorch's rule). **Local**.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != len(ndims):
        raise ShardingError(
            f"einsum: equation {equation!r} has {len(subs)} operand(s), got {len(ndims)}"
        )
    spare = [c for c in string.ascii_letters if c not in eq]
    n_ell = 0
    for sub, nd in zip(subs, ndims):
        if "..." in sub:
            n_ell = max(n_ell, nd - (len(sub) - 3))
    ell = "".join(spare[:n_ell])
    out_subs = []
    for sub, nd in zip(subs, ndims):
        if "..." in sub:
            k = nd - (len(sub) - 3)
            sub = sub.replace("...", ell[n_ell - k :] if k else "")
        if len(sub) != nd:
            raise ShardingError(
                f"einsum: subscript {sub!r} of equation {equation!r} does not match an "
                f"operand with {nd} dims"
            )
        out_subs.append(sub)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(out_subs)
        once = (c for c in set(letters) if letters.count(c) == 1 and c not in ell)
        out = ell + "".join(sorted(once))
    return out_subs, out


def einsum_result(
    op: str,
    subs: list[str],
    out_sub: str,
    operands: list[ArgMeta],
    addend: ArgMeta | None,
    order: tuple[int, ...],
    dtype_args: tuple[ArgMeta | None, ...],
    default_float: object,
) -> RuleResult:
    """The product rule (see the module docstring). **Local**.

    ``order`` maps each schema argument to its slot in ``(*operands, addend)``: candidates
    are built in that canonical order and then laid out in argument order.
    """
    sizes: dict[str, int] = {}
    for sub, a in zip(subs, operands):
        for c, n in zip(sub, a.shape):
            if n != 1 or c not in sizes:
                sizes[c] = n
    out_shape = tuple(sizes[c] for c in out_sub)
    if addend is not None and broadcast_shapes(op, [addend.shape, out_shape]) != out_shape:
        raise ShardingError(
            f"{op}: the added tensor of shape {addend.shape} does not broadcast to the "
            f"product's shape {out_shape}"
        )
    out_nd = len(out_shape)

    def addend_shard(j: int):
        bd = j - out_nd + len(addend.shape)  # type: ignore[union-attr]
        return S(bd) if bd >= 0 and addend.shape[bd] == out_shape[j] else R  # type: ignore[union-attr]

    def op_shard(sub: str, a: ArgMeta, c: str):
        pos = sub.find(c)
        return R if pos < 0 or a.shape[pos] != sizes[c] else S(pos)

    canon: list[tuple] = [(R,) * (1 + len(operands) + (addend is not None))]
    tail: tuple = ()
    for c in sizes:
        if any(sub.count(c) > 1 for sub in subs):
            continue  # a diagonal: keep it unsharded
        j = out_sub.find(c)
        pls = tuple(op_shard(sub, a, c) for sub, a in zip(subs, operands))
        if j >= 0:
            tail = (addend_shard(j),) if addend is not None else ()
            canon.append((S(j), *pls, *tail))
        else:
            tail = (P("sum"),) if addend is not None else ()
            canon.append((P("sum"), *pls, *tail))
    for k in ("sum", "avg"):
        for i in range(len(operands)):
            pls = tuple(P(k) if t == i else R for t in range(len(operands)))
            canon.append((P(k), *pls, *((P(k),) if addend is not None else ())))
        if addend is not None and k == "avg":  # a P(sum) addend alone would count the
            canon.append((P(k), *((R,) * len(operands)), P(k)))  # product once per coord
    cands = tuple(Candidate((pl[0], *(pl[1 + s] for s in order))) for pl in canon)
    dtype = result_dtype(dtype_args, default_float)  # type: ignore[arg-type]
    return RuleResult((out_shape,), (dtype,), cands)


def check_sizes(
    op: str,
    subs: list[str],
    operands: list[ArgMeta],
    loose: str,
    equation: str | None = None,
) -> None:
    """Raise ShardingError unless the operands' GLOBAL sizes agree on every subscript.

    **Local**: a pure function of the global shapes, so every rank raises the same error
    before any redistribution or local kernel runs. A letter in ``loose`` broadcasts (size
    1 against n, across operands: einsum's letters, matmul's batch dims); the others must
    match exactly (contracted dims, ``bmm``'s batch). ``equation`` is einsum's, for the
    message.
    """
    first: dict[str, tuple[int, int, int]] = {}  # letter -> (operand, dim, size)
    for i, (sub, a) in enumerate(zip(subs, operands)):
        for pos, (c, n) in enumerate(zip(sub, a.shape)):
            j, jpos, m = first.setdefault(c, (i, pos, n))
            if m == n or (c in loose and i != j and 1 in (m, n)):
                if m == 1:
                    first[c] = (i, pos, n)
                continue
            if equation is not None:
                name = repr(c) if c in equation else "'...'"
                raise ShardingError(
                    f"einsum: subscript {name} of equation {equation!r} is {m} in dim {jpos} "
                    f"of operand {j} of shape {operands[j].shape} but {n} in dim {pos} of "
                    f"operand {i} of shape {a.shape}"
                )
            shapes = " and ".join(str(b.shape) for b in operands)
            raise ShardingError(f"{op}: shapes {shapes} cannot be multiplied ({m} != {n})")


_BATCH = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # matmul's batch letters (they broadcast)


def _matmul_subs(op: str, sa: tuple[int, ...], sb: tuple[int, ...]) -> tuple[list[str], str]:
    if not sa or not sb:
        raise ShardingError(
            f"{op}: both arguments need to be at least 1D, but they are {len(sa)}D and "
            f"{len(sb)}D"
        )
    nb = max(len(sa), len(sb)) - 2
    batch = _BATCH[: max(nb, 0)]
    a = "k" if len(sa) == 1 else batch[len(batch) - (len(sa) - 2) :] + "mk"
    b = "k" if len(sb) == 1 else batch[len(batch) - (len(sb) - 2) :] + "kn"
    out = batch + ("m" if len(sa) > 1 else "") + ("n" if len(sb) > 1 else "")
    return [a, b], out


_FIXED = {"mm": (["mk", "kn"], "mn"), "bmm": (["bmk", "bkn"], "bmn"),
          "dot": (["k", "k"], ""), "outer": (["m", "n"], "mn")}


@register_rule(
    "matmul", "mm", "bmm", "dot", "outer", "addmm", "linear", "einsum",
    static={"einsum": ("equation",)},
)
def product_rule(schema: OpSchema) -> RuleResult:
    """Rule of every product, through one einsum analysis. **Local**."""
    op = schema.op
    args = schema.args
    addend = None
    if op == "einsum":
        operands = list(args)
        subs, out = parse_einsum(str(schema.get("equation")), [len(a.shape) for a in operands])
        order = tuple(range(len(operands)))
    elif op == "addmm":  # addmm(input, mat1, mat2): input is added
        addend, operands = args[0], list(args[1:3])
        subs, out = ["mk", "kn"], "mn"
        order = (2, 0, 1)
    elif op == "linear":  # linear(input, weight, bias=None)
        operands = list(args[:2])
        x, w = operands
        if len(w.shape) not in (1, 2):
            raise ShardingError(f"linear: weight must be 1-D or 2-D, got {len(w.shape)}-D")
        subs, out = _matmul_subs(op, x.shape, w.shape[::-1])
        subs[1] = subs[1][::-1]  # the weight is (out, in): its subscript reversed
        addend = args[2] if len(args) > 2 else None
        order = (0, 1, 2) if len(args) > 2 else (0, 1)
    else:
        operands = list(args[:2])
        if op in _FIXED:
            subs, out = _FIXED[op]
            for sub, a in zip(subs, operands):
                if len(sub) != len(a.shape):
                    raise ShardingError(
                        f"{op}: expected {len(sub)}-D operands, got shapes "
                        f"{operands[0].shape} and {operands[1].shape}"
                    )
        else:
            subs, out = _matmul_subs(op, operands[0].shape, operands[1].shape)
        order = (0, 1)
    equation = str(schema.get("equation")) if op == "einsum" else None
    check_sizes(op, list(subs), operands, _BATCH if equation is None else "".join(subs), equation)
    if addend is None and len(order) > len(operands):  # linear without bias
        order = order[: len(operands)]
    result = einsum_result(
        op, list(subs), out, operands, addend, order, args, schema.default_float
    )
    if op == "linear" and len(args) > 2 and args[2] is None:
        # bias=None passed explicitly: its slot is None in every candidate
        return RuleResult(
            result.out_shapes,
            result.out_dtypes,
            tuple(Candidate((*c.placements, None)) for c in result.candidates),
        )
    return result
