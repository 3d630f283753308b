"""Human-readable rendering of redistribute plans.

This module owns :func:`explain_plan`: one line per step with the placements before and
after, the primitive and its arguments, the bytes each rank moves and the estimated time, then
a total line. Pure: nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from placements.layout import normalize_placements
from placements.spec import DTensorSpec
from placements.types import Placement, short_placements

from .cost import CostModel, buffer_bytes, default_cost_model, step_cost
from .plan import Step, plan

__all__ = ["explain_plan", "format_bytes", "format_seconds"]

# kind -> the step's arguments after its mesh dim
_ARGS: dict[str, Callable[[Step], str]] = {
    "all_gather": lambda s: f"tensor dim {s.tensor_dim}",
    "reduce_scatter": lambda s: f"tensor dim {s.tensor_dim}, {s.reduce_op}",
    "all_reduce": lambda s: s.reduce_op,
    "all_to_all": lambda s: f"tensor dim {s.src_dim} -> {s.dst_dim}",
    "local_chunk": lambda s: f"tensor dim {s.tensor_dim}",
    "partition_partial": lambda s: s.reduce_op,
}


def format_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``2.0 MiB``, ``3.2 GiB``. **Local**."""
    if n < 1024:
        return f"{round(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def format_seconds(t: float) -> str:
    """``0.41 ms`` from 0.1 ms up, ``12.5 us`` below. **Local**."""
    if t >= 1e-4:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def explain_plan(
    src_spec: DTensorSpec,
    dst_placements: Sequence[Placement],
    cost_model: CostModel | None = None,
    async_op: bool = False,
) -> str:
    """Render the plan from ``src_spec`` to ``dst_placements``, one line per step. **Local**.

    Example::

        S(0),R -> R,R: all_gather(mesh dim 0, tensor dim 0, 2.0 MiB, ~0.42 ms)
        total: 1 step, 2.0 MiB, ~0.42 ms

    Bytes are the largest buffer each collective touches on a rank (the largest over ranks),
    as :class:`dtensor.debug.CommDebugMode` counts them; times come from the cost model. Local steps say ``no communication``; an empty plan is one line ending in
    ``no communication``.

    Parameters
    ----------
    src_spec : DTensorSpec
        The source spec.
    dst_placements : sequence of Placement
        The target placements.
    cost_model : CostModel, optional
        Used both to choose and to price the plan; defaults to the process-wide model.
    async_op : bool
        The plan of ``redistribute(..., async_op=True)``: each collective's line ends in
        ``, async``.
    """
    model = cost_model or default_cost_model()
    steps = plan(src_spec, dst_placements, model)
    if not steps:
        dst = normalize_placements(dst_placements, src_spec.shape, src_spec.mesh_shape)
        src = short_placements(src_spec.placements)
        return f"{src} -> {short_placements(dst)}: no communication"
    lines = []
    total_bytes = 0
    total_time = 0.0
    for step in steps:
        args = f"mesh dim {step.mesh_dim}, {_ARGS[step.kind](step)}"
        nbytes = buffer_bytes(step, src_spec)
        seconds = step_cost(step, src_spec, model)
        total_bytes += nbytes
        total_time += seconds
        cost = (
            f"{format_bytes(nbytes)}, ~{format_seconds(seconds)}"
            if step.communicates
            else "no communication"
        )
        if async_op and step.communicates:
            cost += ", async"
        lines.append(
            f"{short_placements(step.before)} -> {short_placements(step.after)}: "
            f"{step.kind}({args}, {cost})"
        )
    noun = "step" if len(steps) == 1 else "steps"
    lines.append(
        f"total: {len(steps)} {noun}, {format_bytes(total_bytes)}, ~{format_seconds(total_time)}"
    )
    return "\n".join(lines)
