"""Splitting a ``dt.nn`` model into pipeline stages: by module path (split points as
PyTorch's ``{"blocks.2": SplitPoint.BEGINNING}``) or by an equal-cost split.

A model is read as a sequence of *units*: its top-level children in registration order,
with each container (``ModuleList``, ``Sequential``, ``ModuleDict``) opened into its items
(``blocks.0``, ``blocks.1``...), the *layers*. A split point names the unit a stage
begins with. A stage module is a deep copy of the whole model with the units of other
stages removed: a top-level child becomes None, a container item is dropped *keeping its
key*, so every parameter keeps its full name (``blocks.2.attn.wq.weight`` on stage 1 as in
the model), which is what a checkpoint of a pipelined model is written with. The model's
``forward`` must run on such a copy: skip a child that is None, iterate over the container
(the GPT of ``launch/examples/gpt.py`` does: the first stage embeds, the last applies the
final norm and head, every stage runs the blocks it holds).

Tied parameters (one Parameter under several names, as the GPT's head and token
embedding) that end up in several stages become one copy per stage; the schedules sum
their gradients between those stages after the backward (:func:`ties_of` says which), so
that every copy gets the gradient of the tied parameter of the local model and, updated
alike, stays equal to the others.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence

from placements.errors import PipelineError

from ..nn import Embedding, Module, ModuleDict, ModuleList, Sequential

__all__ = ["equal_cost_split_points", "pipeline_split", "ties_of"]

_CONTAINERS = (ModuleList, Sequential, ModuleDict)
#: stage module -> {tie key: {stage: parameter name in that stage}}
_TIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _units(model: Module) -> list[tuple[str, Module, bool]]:
    """``(path, module, is_layer)`` of the model's units, in order."""
    if not isinstance(model, Module):
        raise PipelineError(f"pipeline_split: model must be a dt.nn.Module, got "
                            f"{type(model).__name__}")
    out = []
    for name, child in model._modules.items():
        if child is None:
            continue
        if isinstance(child, _CONTAINERS):
            out += [(f"{name}.{k}", m, True) for k, m in child._modules.items() if m is not None]
        else:
            out.append((name, child, False))
    if not out:
        raise PipelineError(f"pipeline_split: {type(model).__name__} has no submodules to split")
    return out


def _unit_cost(module: Module, cost: str | Callable) -> float:
    if callable(cost):
        return float(cost(module))
    total = 0.0
    for mod in module.modules():
        for p in mod._parameters.values():
            if p is None:
                continue
            n = float(p.numel())
            total += n if cost == "params" else (0.0 if isinstance(mod, Embedding) else 2 * n)
    return total


def equal_cost_split_points(model: Module, num_stages: int,
                            cost: str | Callable = "flops") -> list[str]:
    """Split points (unit paths a stage begins with) that balance the stages' cost.
    **Local** (deterministic: every rank gets the same answer).

    Stages begin at layers only (the container items; units before the first layer join
    the first stage, units after a layer join its stage), and every stage holds at least
    one layer. The split minimises the largest stage cost.

    Parameters
    ----------
    cost : "flops", "params" or callable
        ``"flops"``: 2 FLOPs per parameter per token for every module but embeddings (a
        lookup), each use of a tied parameter counted (the GPT's head); ``"params"``: the
        parameter count; a callable: ``cost(unit_module) -> float``.

    Raises
    ------
    PipelineError
        More stages than layers (a stage would be empty), an unknown cost.
    """
    if not (callable(cost) or cost in ("flops", "params")):
        raise PipelineError(f"pipeline_split: cost must be 'flops', 'params' or a callable, "
                            f"got {cost!r}")
    units = _units(model)
    _check_count(num_stages)
    costs = [_unit_cost(m, cost) for _, m, _ in units]
    layers = [i for i, (_, _, is_layer) in enumerate(units) if is_layer]
    if num_stages - 1 > max(len(layers) - 1, 0) or (num_stages > 1 and not layers):
        names = [units[i][0] for i in layers]
        raise PipelineError(f"pipeline_split: {num_stages} stages of {len(layers)} layers "
                            f"({names}): a stage would be empty")
    if num_stages == 1:
        return []
    cands = layers[1:]
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    n = len(units)

    def span(a: int, b: int) -> float:
        return pre[b] - pre[a]

    # best[k][j]: the least largest cost of stages 0..k when stage k+1 begins at cands[j]
    best = [[span(0, c) for c in cands]]
    back: list[list[int]] = [[-1] * len(cands)]
    for _ in range(1, num_stages - 1):
        row, brow = [], []
        for j, c in enumerate(cands):
            opts = [(max(best[-1][i], span(cands[i], c)), i) for i in range(j)]
            v, i = min(opts) if opts else (float("inf"), -1)
            row.append(v)
            brow.append(i)
        best.append(row)
        back.append(brow)
    final = [(max(best[-1][j], span(c, n)), j) for j, c in enumerate(cands)]
    _, j = min(final)
    points = []
    for k in range(num_stages - 2, -1, -1):
        points.append(cands[j])
        j = back[k][j]
    return [units[i][0] for i in reversed(points)]


def _check_count(num_stages: object) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PipelineError(f"pipeline_split: num_stages={num_stages!r} must be an int >= 1")


def pipeline_split(model: Module, num_stages: int | None = None,
                   split_points: Sequence[str] | None = None, *,
                   cost: str | Callable = "flops",
                   stages: Sequence[int] | None = None) -> dict[int, Module]:
    """Split ``model`` into pipeline stage modules. **Local** (deterministic).

    Give either ``split_points`` (the unit paths stages 1, 2... begin with, in model order,
    e.g. ``["blocks.2"]`` for two stages) or ``num_stages`` (an equal-cost split, see
    :func:`equal_cost_split_points`); both: they must agree in count.

    Parameters
    ----------
    stages : sequence of int, optional
        The stage indices to build (each a deep copy of the model, pruned); default all.
        A rank builds its own: ``stages=range(pp_rank, num_stages, pp_size)``.

    Returns
    -------
    dict
        ``{stage_index: module}``; parameters keep their full names.

    Raises
    ------
    PipelineError
        A split point that is not a unit of the model, split points out of order or
        repeated (a stage left empty), a count that does not match ``num_stages``.
    """
    units = _units(model)
    names = [u for u, _, _ in units]
    if split_points is None:
        if num_stages is None:
            raise PipelineError("pipeline_split: give num_stages or split_points")
        split_points = equal_cost_split_points(model, num_stages, cost)
    split_points = list(split_points)
    if num_stages is not None:
        _check_count(num_stages)
        if len(split_points) != num_stages - 1:
            raise PipelineError(f"pipeline_split: {len(split_points)} split points "
                                f"{split_points} make {len(split_points) + 1} stages, "
                                f"not num_stages={num_stages}")
    n_st = len(split_points) + 1
    starts = [0]
    for k, point in enumerate(split_points):
        if point not in names:
            raise PipelineError(f"pipeline_split: split point {point!r} is not a unit of "
                                f"{type(model).__name__} (units: {names})")
        i = names.index(point)
        if i <= starts[-1]:
            raise PipelineError(f"pipeline_split: stage {k} would be empty: split point "
                                f"{point!r} does not come after {names[starts[-1]]!r} "
                                f"(split points {split_points})")
        starts.append(i)
    stage_of = {}
    bounds = starts + [len(units)]
    for s in range(n_st):
        for u in names[bounds[s]:bounds[s + 1]]:
            stage_of[u] = s
    ties = _tie_groups(model, stage_of)
    wanted = range(n_st) if stages is None else list(stages)
    out = {}
    for s in wanted:
        if not isinstance(s, int) or not 0 <= s < n_st:
            raise PipelineError(f"pipeline_split: stage {s!r} is not in [0, {n_st})")
        out[s] = _prune(model, {u for u, st in stage_of.items() if st == s})
        _TIES[out[s]] = {k: g for k, g in ties.items() if s in g}
    return out


def _unit_of(name: str, stage_of: dict[str, int]) -> str | None:
    parts = name.split(".")
    for k in (2, 1):
        if ".".join(parts[:k]) in stage_of:
            return ".".join(parts[:k])
    return None


def _tie_groups(model: Module, stage_of: dict[str, int]) -> dict[str, dict[int, str]]:
    """``{key: {stage: name}}`` of the parameters held under several names in several
    stages (the key: the first name)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    out = {}
    for fqns in by_id.values():
        per: dict[int, str] = {}
        for name in fqns:
            unit = _unit_of(name, stage_of)
            if unit is not None:
                per.setdefault(stage_of[unit], name)
        if len(per) > 1:
            out[fqns[0]] = per
    return out


def _prune(model: Module, keep: set[str]) -> Module:
    # the units of other stages are not copied (the memo maps them to None): a stage's
    # build holds its own parameters, not a second whole model
    memo: dict[int, object] = {}
    for name, child in model._modules.items():
        if child is None:
            continue
        if isinstance(child, _CONTAINERS):
            for k, sub in child._modules.items():
                if sub is not None and f"{name}.{k}" not in keep:
                    memo[id(sub)] = None
        elif name not in keep:
            memo[id(child)] = None
    # the copies are parameters with the originals' requires_grad, ties within the stage
    # shared (one copy per original)
    stage = copy.deepcopy(model, memo)
    for name, child in list(stage._modules.items()):
        if child is None:
            continue
        if isinstance(child, _CONTAINERS):
            for k in [k for k in child._modules if f"{name}.{k}" not in keep]:
                del child._modules[k]
        elif name not in keep:
            stage._modules[name] = None
    return stage


def ties_of(stage_module: Module) -> dict[str, dict[int, str]]:
    """The tied-parameter groups a stage module of :func:`pipeline_split` takes part in:
    ``{key: {stage: parameter name}}``; empty for any other module. **Local**."""
    return _TIES.get(stage_module, {})
