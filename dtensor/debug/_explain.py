"""``explain``: what an op (or a whole function, or a redistribute) will communicate, and why.

This module owns :func:`explain` and its result types. For one table op it runs the
dispatcher's own decision (sharding rule -> cost model -> cheapest strategy -> stored
redistribute plans) on metadata only, without running the op; it also prices every valid
candidate strategy so the choice can be checked. For a function of DTensors it runs the
function once while recording each dispatched op's decision (with the local shapes and
dtypes its kernel sees, enough to price its compute) and every redistribute that changes
placements (explicit calls, ``full_tensor``); when the function runs a backward pass, the
ops its formulas dispatch and the moves of gradients back to the inputs' and leaves'
placements are recorded too, marked as backward of the op whose node ran them; a pipeline
schedule's point-to-point messages (``explain(schedule.step, x)``) are recorded per stage
(:class:`PointToPoint`). For
``explain(x, placements)`` it renders the redistribute plan
(:func:`redistribute.explain.explain_plan`).
"""

from __future__ import annotations

import difflib
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from placements.errors import DTypeError, NoRuleError, SignatureError
from placements.layout import max_local_shape
from placements.rules import (
    OpSchema,
    OpStrategy,
    defers_partial,
    nd_valid,
    pass_cost,
    reduce_cost,
    rule_result,
    unshard_cost,
)
from placements.spec import DTensorSpec
from placements.types import Partial, Placement, Replicate, placement_list
from redistribute import comm as _comm
from redistribute.cost import buffer_bytes, default_cost_model, step_cost
from redistribute.explain import explain_plan, format_seconds
from redistribute.plan import plan, redistribute_cost

from ..dispatch import dispatcher as _dispatch
from ..distributed.dtensor import (
    DTensor,
    add_redistribute_listener,
    remove_redistribute_listener,
)
from ..local import grad_engine as _ag
from ..ops.table import OPS, OpInfo
from ._comm_mode import p2p_tag

__all__ = ["Collective", "Explanation", "OpExplanation", "PointToPoint", "explain"]

#: N-D combinations of candidates looked at per op at most.
MAX_CANDIDATES = 4096

#: Collective kinds a trace counts as issued (the kinds of redistribute plans).
_COUNTED = frozenset(("all_gather", "reduce_scatter", "all_reduce", "all_to_all"))


@dataclass(frozen=True)
class Collective:
    """One step of a planned input redistribution.

    ``kind`` is the step kind (``all_gather``, ``all_reduce``, ``reduce_scatter``,
    ``all_to_all`` communicate; ``local_chunk`` and ``partition_partial`` do not);
    ``nbytes`` is the largest buffer the collective touches on a rank (what
    ``CommDebugMode`` records) and ``seconds`` the cost model's time estimate.
    """

    op: str
    arg: int
    kind: str
    mesh_dim: int
    communicates: bool
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class OpExplanation:
    """The decision for one op call: inputs, chosen strategy, candidates, collectives.

    ``phase`` is ``"backward"`` for an op dispatched (or a gradient moved, op
    ``"redistribute"``) by a backward pass; ``backward_of`` then names the op whose
    backward node ran it (None for the roots' own gradients).

    ``local_inputs`` holds, per argument, ``(shape, dtype)`` of the local block the kernel
    gets (after the input's redistribution; the largest over ranks) or None for a
    non-tensor argument; ``local_outputs`` the same per output. A ``redistribute`` entry
    holds its input block and its output block."""

    op: str
    inputs: tuple[str, ...]
    input_placements: tuple[str | None, ...]
    output_placements: tuple[str, ...]
    cost_s: float
    candidates: tuple[tuple[str, float], ...]
    candidates_total: int
    plans: tuple[str, ...]
    collectives: tuple[Collective, ...]
    cache: str | None = None
    phase: str = "forward"
    backward_of: str | None = None
    local_inputs: tuple[tuple[tuple[int, ...], str] | None, ...] = ()
    local_outputs: tuple[tuple[tuple[int, ...], str], ...] = ()

    def text(self) -> str:
        """The decision as indented lines. **Local**."""
        head = f"{self.op}({', '.join(self.inputs)})"
        if self.cache is not None:
            head += f"  [propagation cache {self.cache}]"
        if self.phase == "backward":
            head += f"  [backward of {self.backward_of or 'the roots'}]"
        ins = ", ".join("-" if p is None else p for p in self.input_placements)
        lines = [
            head,
            (
                f"  strategy: {', '.join(self.output_placements)} <- {ins}"
                f"  (redistribution ~{format_seconds(self.cost_s)})"
            ),
        ]
        if self.candidates:
            shown = len(self.candidates)
            lines.append(
                f"  candidates ({shown} of {self.candidates_total} valid, cheapest first):"
            )
            for i, (desc, cost) in enumerate(self.candidates):
                mark = "*" if i == 0 else " "
                lines.append(f"   {mark} {desc}  ~{format_seconds(cost)}")
        comm = [c for c in self.collectives if c.communicates]
        if not self.plans:
            lines.append("  collectives: none")
        else:
            lines.append(f"  collectives: {len(comm)}")
            lines += ["    " + line for p in self.plans for line in p.splitlines()]
        return "\n".join(lines)


@dataclass(frozen=True)
class PointToPoint:
    """One point-to-point message of a pipeline schedule, as a traced function posted it on
    this rank: ``kind`` ``"send"`` or ``"recv"``; ``stage`` this rank's stage that sends or
    receives it, ``peer`` the stage at the other end; ``mb`` the micro-batch (-1 for a
    shape header or a tied gradient); ``direction`` ``"activation"``, ``"gradient"``,
    ``"header"`` or ``"tied"``; ``nbytes``; ``phase`` ``"forward"`` (activations, headers)
    or ``"backward"`` (gradients)."""

    kind: str
    stage: int
    peer: int | None
    mb: int
    direction: str
    nbytes: int
    phase: str

    def text(self) -> str:
        """One line. **Local**."""
        arrow = "->" if self.kind == "send" else "<-"
        peer = "?" if self.peer is None else self.peer
        mb = "" if self.mb < 0 else f" mb {self.mb}"
        return (f"{self.kind} {self.direction}{mb} stage {self.stage} {arrow} stage {peer}: "
                f"{self.nbytes} bytes [{self.phase}]")


@dataclass
class Explanation:
    """What :func:`explain` returns; ``str()`` renders it.

    Attributes
    ----------
    ops : list of OpExplanation
        One per op call (one for ``explain(op, ...)``; one per dispatched op, in order, for
        a traced function; none for a redistribute).
    redistribute : str or None
        The plan of ``explain(x, placements)``.
    steps : tuple of Collective
        The steps of that plan (op ``"redistribute"``).
    traced : bool
        Whether the function was run to produce this.
    result : object
        The traced function's return value (None otherwise).
    issued : dict of str to int
        For a traced function: the collectives that actually ran while it ran, by kind
        (every rank's own; compare with :meth:`comm_counts`).
    messages : list of PointToPoint
        For a traced function: the point-to-point messages of a pipeline schedule this
        rank posted, in order (:meth:`p2p_bytes` sums them per stage).
    """

    ops: list[OpExplanation] = field(default_factory=list)
    redistribute: str | None = None
    steps: tuple[Collective, ...] = ()
    traced: bool = False
    result: object = None
    issued: dict[str, int] = field(default_factory=dict)
    messages: list[PointToPoint] = field(default_factory=list)

    def p2p_bytes(self) -> dict[int, dict[str, int]]:
        """Bytes of :attr:`messages` by stage, then ``"<direction> <send|recv>"`` (as
        ``CommDebugMode.get_p2p_bytes``). **Local**."""
        out: dict[int, dict[str, int]] = {}
        for msg in self.messages:
            per = out.setdefault(msg.stage, {})
            key = f"{msg.direction} {msg.kind}"
            per[key] = per.get(key, 0) + msg.nbytes
        return dict(sorted(out.items()))

    def _messages_text(self) -> list[str]:
        """The messages grouped by stage, each stage with its totals."""
        lines = [f"point-to-point (pipeline): {len(self.messages)} messages"]
        for stage, per in self.p2p_bytes().items():
            total = ", ".join(f"{k} {v} bytes" for k, v in per.items())
            lines.append(f"  stage {stage}: {total}")
            lines += [f"    {m.text()}" for m in self.messages if m.stage == stage]
        return lines
    def collectives(self) -> list[Collective]:
        """Every communicating step, in the order they will be (or were) issued. **Local**."""
        all_steps = [*self.steps, *(c for o in self.ops for c in o.collectives)]
        return [c for c in all_steps if c.communicates]

    def comm_counts(self) -> dict[str, int]:
        """Communicating steps by kind (compare with ``CommDebugMode.get_comm_counts``)."""
        out: dict[str, int] = {}
        for c in self.collectives():
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def to_json(self) -> str:
        """The explanation as a JSON document (the traced result is left out). **Local**."""
        data = {
            "ops": [asdict(o) for o in self.ops],
            "redistribute": self.redistribute,
            "steps": [asdict(s) for s in self.steps],
            "traced": self.traced,
            "messages": [asdict(m) for m in self.messages],
        }
        return json.dumps(data, default=str)

    def __str__(self) -> str:
        parts = []
        if self.redistribute is not None:
            parts.append(self.redistribute)
        if self.traced:
            parts.append(
                f"traced (the function ran once): {len(self.ops)} dispatched ops, "
                f"{len(self.collectives())} collectives planned for their inputs"
                + (f" ({sum(o.phase == 'backward' for o in self.ops)} ops and gradient moves "
                   "of backward)" if any(o.phase == "backward" for o in self.ops) else "")
            )
        parts += [o.text() for o in self.ops]
        if self.messages:
            parts += self._messages_text()
        return "\n".join(parts)


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype: object) -> str:
    """``str(dtype)``, cached (numpy computes it in Python on every call)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _describe(v: object) -> str:
    if isinstance(v, DTensor):
        return f"{_dtype_name(v.dtype)}{list(v.shape)}{placement_list(v.placements)}"
    return _dispatch.describe(v)


def _plan_steps(op: str, arg: int, spec: DTensorSpec, steps: Sequence) -> list[Collective]:
    """The steps as records; a step over a mesh dim of size 1 moves nothing."""
    model = default_cost_model()
    return [
        Collective(
            op,
            arg,
            s.kind,
            s.mesh_dim,
            s.communicates and spec.mesh_shape[s.mesh_dim] > 1,
            buffer_bytes(s, spec),
            step_cost(s, spec, model),
        )
        for s in steps
    ]


def _kernel_steps(op: str, strategy: OpStrategy, mesh: object) -> list[Collective]:
    """The all-reduces the kernel of the chosen strategy runs itself (its candidates that
    say :attr:`placements.rules.Candidate.collective`), after the inputs' moves, and its
    ring passes (:attr:`placements.rules.Candidate.passes`: a ``send`` and a ``recv`` of
    the largest block per step, as ``CommDebugMode`` counts them; the pass's cost on its
    sends)."""
    if not strategy.candidates_considered:
        return []
    combo = strategy.candidates_considered[-1][0]  # the chosen one: the last best found
    model = default_cost_model()
    out = []
    nm = len(mesh.shape)
    for m, c in enumerate(combo):
        if not c.collective or mesh.shape[m] == 1:
            continue
        for n in c.reduces:
            pl = tuple(Partial("sum") if k == m else Replicate() for k in range(nm))
            spec = DTensorSpec._trusted(mesh, pl, (n,), strategy.output_specs[0].dtype)
            out.append(Collective(op, 0, "all_reduce", m, True, n * spec.dtype.itemsize,
                                  redistribute_cost(spec, (Replicate(),) * nm, model)))
        k = mesh.shape[m]
        cost_fn = _dispatch._cost_fn({}, mesh)
        for n in c.passes:
            dtype = strategy.output_specs[0].dtype
            block = -(-n // k) * dtype.itemsize
            each = pass_cost(cost_fn, m, tuple(mesh.shape), n, dtype) / (k - 1)
            for _ in range(k - 1):
                out.append(Collective(op, 0, "send", m, True, block, each))
                out.append(Collective(op, 0, "recv", m, True, block, 0.0))
    return out


def _is_partial(v: object, m: int) -> bool:
    return isinstance(v, DTensor) and v.placements[m].kind == "P"


def _candidates(
    schema: OpSchema, args: Sequence[object], mesh: object
) -> tuple[list[tuple[str, float]], int]:
    """Every valid N-D candidate of the op's rule with its cost (the redistribution of its
    inputs, the all-reduces it implies and the gather a sharding it introduces implies:
    :func:`placements.rules.unshard_cost`), cheapest first (ties in candidate-list order);
    at most :data:`MAX_CANDIDATES` are priced."""
    mesh_ndim = len(mesh.shape)
    result = rule_result(schema)
    n_out = len(result.out_shapes)
    cost_fn = _dispatch._cost_fn({}, mesh)
    dtype = result.out_dtypes[0]
    # As the dispatcher does: never turn an input into a Partial only to defer a reduction.
    held = [
        {v.placements[m].reduce_op for v in args if _is_partial(v, m)} for m in range(mesh_ndim)
    ]
    # As the dispatcher does: a Shard output where no argument is sharded costs its gather.
    sharded = [any(isinstance(v, DTensor) and v.placements[m].is_shard() for v in args)
               for m in range(mesh_ndim)]
    priced = []
    combos = itertools.islice(
        itertools.product(result.candidates, repeat=mesh_ndim), MAX_CANDIDATES
    )
    for order, combo in enumerate(combos):
        if not nd_valid(result, combo):
            continue
        cost = sum(reduce_cost(cost_fn, m, mesh_ndim, n, dtype)
                   for m, c in enumerate(combo) for n in c.reduces)
        cost += sum(pass_cost(cost_fn, m, tuple(mesh.shape), n, dtype)
                    for m, c in enumerate(combo) for n in c.passes)
        cost += sum(unshard_cost(cost_fn, result, c, m, mesh_ndim)
                    for m, c in enumerate(combo) if not sharded[m])
        ins = []
        for i, v in enumerate(args):
            j = n_out + i
            if not isinstance(v, DTensor):
                ins.append("-" if combo[0].placements[j] is None else "scalar")
                continue
            cur = v.placements
            target = tuple(
                cur[m] if c.placements[j] is None else c.placements[j] for m, c in enumerate(combo)
            )
            if any(c.placements[j] is not None
                   and defers_partial(c.placements, n_out, c.placements[j], held[m])
                   for m, c in enumerate(combo)):
                break
            cost += redistribute_cost(v._spec, target)
            ins.append(placement_list(target))
        else:
            outs = [
                placement_list(tuple(c.placements[k] for c in combo))
                for k in range(n_out)
            ]
            desc = f"{', '.join(outs)} <- {', '.join(ins)}"
            rings = [m for m, c in enumerate(combo) if c.passes and mesh.shape[m] > 1]
            if rings:  # the kernel's own point-to-point traffic (ring attention)
                desc += f"  [ring over mesh dim {rings[0]}]"
            priced.append((cost, order, desc))
    priced.sort()
    return [(desc, cost) for cost, _, desc in priced], len(priced)


def _local_block(spec: DTensorSpec, placements: tuple) -> tuple[tuple[int, ...], str]:
    """``(shape, dtype)`` of the largest local block of ``spec``'s tensor under
    ``placements``."""
    return max_local_shape(spec.shape, spec.mesh_shape, placements), _dtype_name(spec.dtype)


def _local_inputs(args: Sequence[object], targets: Sequence) -> tuple:
    """Per argument, the local block its kernel gets (see :class:`OpExplanation`)."""
    out = []
    for v, target in zip(args, targets):
        if isinstance(v, DTensor):
            out.append(_local_block(v._spec, v.placements if target is None else tuple(target)))
        elif hasattr(v, "shape") and hasattr(v, "dtype"):  # a local tensor
            out.append((tuple(v.shape), _dtype_name(v.dtype)))
        else:
            out.append(None)
    return tuple(out)


def _explain_entry(
    info: OpInfo,
    entry: _dispatch.CacheEntry,
    values: list,
    mesh: object,
    cache: str | None,
    top: int,
) -> OpExplanation:
    """Describe a decision of the dispatcher (``entry``) for the bound call ``values``."""
    args = entry.arguments(values)
    candidates, total = _candidates(entry.schema, args, mesh) if top else ([], 0)
    strategy = entry.strategy
    plans = []
    steps: list[Collective] = []
    for i, move in enumerate(entry.moves):
        if isinstance(move, _dispatch.Redist) and move.steps:
            text = explain_plan(move.src, move.dst.placements)
            plans.append(f"arg {i}: " + text.replace("\n", f"\narg {i}: "))
            steps += _plan_steps(info.name, i, move.src, move.steps)
    steps += _kernel_steps(info.name, strategy, mesh)
    return OpExplanation(
        op=info.name,
        inputs=tuple(_describe(v) for v in args),
        input_placements=tuple(
            None if p is None else placement_list(p)
            for p in strategy.input_placements
        ),
        output_placements=tuple(
            placement_list(s.placements) for s in strategy.output_specs
        ),
        cost_s=float(strategy.cost),
        candidates=tuple(candidates[:top]),
        candidates_total=total,
        plans=tuple(plans),
        collectives=tuple(steps),
        cache=cache,
        local_inputs=_local_inputs(args, strategy.input_placements),
        local_outputs=tuple(_local_block(s, s.placements) for s in strategy.output_specs),
    )


def _table_op(op: object) -> tuple[OpInfo, tuple] | None:
    """The table entry that ``op`` names (an op name, a ``dt`` function or a bound DTensor
    method) and the arguments it already binds; None for any other callable."""
    if isinstance(op, str):
        if op not in OPS:
            close = difflib.get_close_matches(op, list(OPS), n=1)
            hint = f"; the closest is {close[0]!r}" if close else ""
            raise NoRuleError(f"explain: {op!r} is not an op of the table{hint}")
        return OPS[op], ()
    name = getattr(op, "__name__", None)
    if name not in OPS:
        return None
    owner = getattr(op, "__self__", None)
    if isinstance(owner, DTensor):
        return OPS[name], (owner,)
    if owner is None and str(getattr(op, "__module__", "")).startswith("dtensor"):
        return OPS[name], ()
    return None


def _explain_op(info: OpInfo, args: tuple, kwargs: dict, top: int) -> Explanation:
    entry, values, mesh = _dispatch.decide(info, args, kwargs)
    return Explanation(ops=[_explain_entry(info, entry, values, mesh, None, top)])


def _phase(e: OpExplanation) -> OpExplanation:
    """``e`` marked as backward when a backward pass runs now."""
    if not _ag.in_backward():
        return e
    return replace(e, phase="backward", backward_of=_ag.current_backward())


def _move(g: DTensor, target: tuple) -> OpExplanation:
    """A redistribute (explicit, ``full_tensor``'s, or a gradient's move in backward), as an
    op entry ``redistribute``."""
    spec = g._spec
    steps = plan(spec, target)
    text = explain_plan(spec, target)
    collectives = tuple(_plan_steps("redistribute", 0, spec, steps))
    src, dst = placement_list(spec.placements), placement_list(target)
    return OpExplanation(
        op="redistribute", inputs=(_describe(g),), input_placements=(src,),
        output_placements=(dst,), cost_s=float(sum(c.seconds for c in collectives)),
        candidates=(), candidates_total=0, plans=(text,) if steps else (),
        collectives=collectives, local_inputs=(_local_block(spec, spec.placements),),
        local_outputs=(_local_block(spec, target),),
    )


def _trace(fn: Callable, args: tuple, kwargs: dict, top: int) -> Explanation:
    ops: list[OpExplanation] = []

    def record(entry: _dispatch.CacheEntry, miss: bool, values: list, mesh: object) -> None:
        info = OPS[entry.name]
        e = _explain_entry(info, entry, values, mesh, "miss" if miss else "hit", top)
        ops.append(_phase(e))

    def moved(g: DTensor, target: tuple) -> None:
        ops.append(_phase(_move(g, target)))

    issued: dict[str, int] = {}
    messages: list[PointToPoint] = []

    def ran(kind: str, nbytes: int, comm: object) -> None:
        if kind in _COUNTED:
            issued[kind] = issued.get(kind, 0) + 1
        tag = p2p_tag(kind)
        if tag is not None:
            stage, mb, direction, peer, phase = tag
            messages.append(PointToPoint(kind, stage, peer, mb, direction, nbytes, phase))

    # The observer also makes the compiled redistribute defer to the Python method, whose
    # listeners see every move.
    _dispatch.add_listener(record)
    add_redistribute_listener(moved)
    _comm.add_observer(ran)
    try:
        result = fn(*args, **kwargs)
    finally:
        _comm.remove_observer(ran)
        remove_redistribute_listener(moved)
        _dispatch.remove_listener(record)
    return Explanation(ops=ops, traced=True, result=result, issued=issued, messages=messages)


def explain(op: object, *args: object, top: int = 6, **kwargs: object) -> Explanation:
    """Explain the sharding decision and the communication of an op, a function or a
    redistribute.

    Three forms:

    - ``explain(x, placements)`` with a DTensor ``x`` and a list of placements: the plan of
      ``x.redistribute(x.device_mesh, placements)``, one line per step with bytes and the
      estimated time. **Local**, nothing runs. ``explain(x, placements, async_op=True)``
      marks the collectives ``async`` (``redistribute(..., async_op=True)`` runs them on a
      worker thread).
    - ``explain(op, *args, **kwargs)`` where ``op`` is a table op: its name (``"matmul"``),
      its ``dt`` function (``dt.matmul``) or a bound DTensor method (``x.sum``). Runs the
      dispatcher's decision on metadata only, *before* (and without) running the op: the
      chosen strategy, up to ``top`` candidate strategies with their redistribution costs
      (cheapest first, the chosen one marked ``*``), and the collectives it will issue
      with bytes and estimated times. **Local**, nothing runs or communicates.
    - ``explain(fn, *args, **kwargs)`` for any other callable (a function of DTensors):
      *runs* ``fn(*args, **kwargs)`` once and records each dispatched op's decision as
      above, marking propagation-cache hits and misses; the return value is in
      ``.result``. **Collective** (it runs the function). A backward pass inside the
      function is traced too: the ops its formulas dispatch and the moves of gradients
      back to inputs' and leaves' placements (op ``redistribute``), each marked
      ``phase="backward"`` with the op whose backward ran it (``backward_of``). Explicit
      redistributes that change placements (``x.redistribute``, ``full_tensor``) are
      entries ``redistribute`` too, in the phase they run in. Every entry holds the local
      blocks (shape, dtype) its kernel reads and writes (``local_inputs``,
      ``local_outputs``). ``.issued`` counts the collectives that really ran. With
      ``top=0`` the candidate strategies are not priced (a faster trace). For a pipeline
      schedule's step (``explain(schedule.step, x)``) the point-to-point messages this rank
      posts are listed per stage with their bytes, direction and phase
      (``.messages``, ``.p2p_bytes()``).

    Parameters
    ----------
    op : DTensor, str or callable
        What to explain (see above).
    *args, **kwargs
        The op's or the function's arguments (or the target placements).
    top : int
        How many candidate strategies to list per op.

    Returns
    -------
    Explanation
        ``print(explain(...))`` shows it; ``.collectives()`` and ``.comm_counts()`` give
        what it predicts, comparable with :class:`CommDebugMode`.
    """
    if isinstance(op, DTensor):
        async_op = kwargs.get("async_op", False)
        if len(args) != 1 or set(kwargs) - {"async_op"} or type(async_op) is not bool:
            raise SignatureError(
                "explain(x, placements, async_op=False): give exactly the target placements "
                "(and async_op, a bool)"
            )
        placements = tuple(args[0])
        if not all(isinstance(p, Placement) for p in placements):
            raise DTypeError(f"explain(x, placements): not a list of placements: {args[0]!r}")
        spec = op._spec
        steps = plan(spec, placements)
        text = explain_plan(spec, placements, async_op=async_op)
        describe = getattr(spec.mesh.get_group(0), "describe", None)  # device meshes
        if describe is not None and steps:
            text += f"\ndevice buffers: {describe()}"
        return Explanation(
            redistribute=text,
            steps=tuple(_plan_steps("redistribute", 0, spec, steps)),
        )
    found = _table_op(op)
    if found is not None:
        info, bound = found
        return _explain_op(info, (*bound, *args), kwargs, top)
    if not callable(op):
        raise DTypeError(f"explain: expected a DTensor, an op or a callable, got {op!r}")
    return _trace(op, args, kwargs, top)
