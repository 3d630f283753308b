"""``get_state_dict`` / ``set_state_dict``: a model's and its optimizers' state keyed by
parameter names (PyTorch's ``torch.distributed.checkpoint.state_dict``), which is what a
checkpoint needs to resume under another parallel layout: an optimizer's own
``state_dict`` keys its state by parameter index, and index orders are the optimizer's.

Both work on any object with ``named_parameters()``, ``state_dict()`` and
``load_state_dict()`` (a ``dt.nn.Module``) and optimizers with ``param_groups``,
``state_dict()`` and ``load_state_dict()`` (``dt.optim``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from placements.errors import ArgumentError

__all__ = ["get_state_dict", "set_state_dict"]


def _optimizers(optimizers: Any) -> list:
    if optimizers is None:
        return []
    if isinstance(optimizers, Sequence):
        return list(optimizers)
    return [optimizers]


def _names(model: Any) -> dict[int, str]:
    """Parameter name by id (the first name of a tied parameter)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def _order(opt: Any) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def get_state_dict(model: Any, optimizers: Any = None) -> tuple[dict, dict]:
    """``(model_state_dict, optimizer_state_dict)``, the optimizer's keyed by parameter name:
    ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}`` (several
    optimizers' merged). The tensors are the model's and the optimizers' own; save them
    with :func:`dtensor.save`. **Local**.

    Raises
    ------
    ArgumentError
        An optimizer parameter that is not a parameter of ``model``.
    """
    names = _names(model)
    state: dict[str, Any] = {}
    groups: list[dict] = []
    for opt in _optimizers(optimizers):
        sd = opt.state_dict()
        order = _order(opt)
        for p in order:
            if id(p) not in names:
                raise ArgumentError(
                    f"get_state_dict: {type(opt).__name__} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of {type(model).__name__}"
                )
        for i, s in sd["state"].items():
            state[names[id(order[i])]] = s
        for g in sd["param_groups"]:
            groups.append({**g, "params": [names[id(order[i])] for i in g["params"]]})
    return model.state_dict(), {"state": state, "param_groups": groups}


def set_state_dict(model: Any, optimizers: Any = None, *,
                   model_state_dict: Mapping[str, Any] | None = None,
                   optim_state_dict: Mapping[str, Any] | None = None,
                   strict: bool = True) -> None:
    """Load what :func:`get_state_dict` gave (possibly saved under another layout and read
    back with :func:`dtensor.load`): the model's state with ``load_state_dict(strict=)``,
    then each optimizer's, its groups and state matched by parameter name.
    **Collective** where a value is redistributed onto a DTensor parameter's layout.

    Raises
    ------
    ArgumentError
        Optimizer groups whose parameter names differ from the saved ones.
    """
    if model_state_dict is not None:
        model.load_state_dict(model_state_dict, strict=strict)
    if optim_state_dict is None:
        return
    names = _names(model)
    saved_groups = list(optim_state_dict["param_groups"])
    saved_state = optim_state_dict["state"]
    for opt in _optimizers(optimizers):
        order = _order(opt)
        index = {names[id(p)]: i for i, p in enumerate(order) if id(p) in names}
        groups, state = [], {}
        for g in opt.param_groups:
            want = [names.get(id(p)) for p in g["params"]]
            match = next((s for s in saved_groups if set(s["params"]) == set(want)), None)
            if match is None:
                raise ArgumentError(
                    f"set_state_dict: no saved parameter group holds the parameters {want[:4]}"
                    f"{'...' if len(want) > 4 else ''} of a {type(opt).__name__} group"
                )
            saved_groups.remove(match)
            groups.append({**match, "params": [index[n] for n in want]})
            for n in want:
                if n in saved_state:
                    state[index[n]] = saved_state[n]
        opt.load_state_dict({"state": state, "param_groups": groups})
