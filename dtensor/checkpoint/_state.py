"""The structure of a checkpoint's state: nested dicts, lists and tuples whose leaves are
tensors (DTensor, local Tensor, numpy array or numpy scalar) or python values.

:func:`flatten` turns a state into a JSON skeleton and the list of its tensor leaves with
their keys (``"model.layers.0.w"``: the path's parts joined by dots);
:func:`build` turns a skeleton and the loaded leaves back into a state.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from placements.errors import ArgumentError, DTypeError

from ..distributed.dtensor import DTensor
from ..local.tensor import Tensor

#: The python values a state may hold as leaves (stored in the metadata as JSON).
VALUE_TYPES = (type(None), bool, int, float, str)


def kind_of(leaf: object) -> str | None:
    """``"dtensor"``, ``"tensor"``, ``"ndarray"`` or ``"scalar"`` for a tensor leaf, None for
    anything else. **Local**."""
    if isinstance(leaf, DTensor):
        return "dtensor"
    if isinstance(leaf, Tensor):
        return "tensor"
    if isinstance(leaf, np.ndarray):
        return "ndarray"
    if isinstance(leaf, np.generic):
        return "scalar"
    return None


def _value(v: Any, key: str, op: str) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}  # JSON has no inf/nan
    if isinstance(v, VALUE_TYPES):
        return v
    raise DTypeError(
        f"{op}: the state's entry {key!r} has type {type(v).__name__}; a checkpoint holds dicts "
        "(str keys), lists, tuples, DTensors, Tensors, numpy arrays and scalars, None, bool, "
        "int, float and str"
    )


def flatten(state: Any, op: str) -> tuple[Any, list[tuple[str, Any]]]:
    """(skeleton, [(key, tensor leaf), ...]) of ``state``, leaves in depth-first order.
    **Local**.

    Skeleton nodes: ``{"dict": [[k, node], ...]}``, ``{"list": [...]}``,
    ``{"tuple": [...]}``, ``{"tensor": i}`` (the i-th leaf) and ``{"value": v}``.

    Raises
    ------
    DTypeError
        A dict key that is not a str, or a leaf of another type.
    ArgumentError
        Two leaves with one key (``{"a.b": x, "a": {"b": y}}``: both are ``"a.b"``, and a
        load would fill both from one saved tensor).
    """
    leaves: list[tuple[str, Any]] = []
    paths: dict[str, str] = {}  # key -> the first leaf's path, as python indexing

    def leaf(key: str, path: str) -> None:
        if key in paths:
            raise ArgumentError(
                f"{op}: the state's entries {paths[key]} and {path} both have the key {key!r} "
                "(keys join the path's parts with dots); rename one of them"
            )
        paths[key] = path

    def walk(node: Any, key: str, path: str) -> Any:
        if isinstance(node, dict):
            items = []
            for k, v in node.items():
                if not isinstance(k, str):
                    raise DTypeError(
                        f"{op}: dict key {k!r} ({type(k).__name__}) under {key or '<root>'!r} is "
                        "not a str"
                    )
                items.append([k, walk(v, f"{key}.{k}" if key else k, f"{path}[{k!r}]")])
            return {"dict": items}
        if isinstance(node, (list, tuple)):
            kind = "list" if isinstance(node, list) else "tuple"
            return {kind: [walk(v, f"{key}.{i}" if key else str(i), f"{path}[{i}]")
                           for i, v in enumerate(node)]}
        leaf(key, path)
        if kind_of(node) is not None:
            leaves.append((key, node))
            return {"tensor": len(leaves) - 1}
        return {"value": _value(node, key, op)}

    return walk(state, "", "state"), leaves


def value_of(stored: Any) -> Any:
    """The python value a skeleton's ``{"value": stored}`` stands for. **Local**."""
    if isinstance(stored, dict):
        return float(stored["float"])
    return stored


def build(node: Any, leaves: list[Any]) -> Any:
    """The state a skeleton describes, its i-th tensor leaf ``leaves[i]``. **Local**."""
    if "dict" in node:
        return {k: build(v, leaves) for k, v in node["dict"]}
    if "list" in node:
        return [build(v, leaves) for v in node["list"]]
    if "tuple" in node:
        return tuple(build(v, leaves) for v in node["tuple"])
    if "tensor" in node:
        return leaves[node["tensor"]]
    return value_of(node["value"])


def values_by_key(node: Any, key: str = "", out: dict | None = None) -> dict[str, Any]:
    """{key: python value} of a skeleton's value leaves. **Local**."""
    out = {} if out is None else out
    if "value" in node:
        out[key] = value_of(node["value"])
    elif "dict" in node:
        for k, v in node["dict"]:
            values_by_key(v, f"{key}.{k}" if key else k, out)
    elif "list" in node or "tuple" in node:
        for i, v in enumerate(node.get("list", node.get("tuple"))):
            values_by_key(v, f"{key}.{i}" if key else str(i), out)
    return out


def replace_values(state: Any, saved: dict[str, Any], key: str = "") -> None:
    """Set the python values and numpy scalars of ``state``'s dicts and lists to
    ``saved[key]`` where ``saved`` holds that key (tuples are immutable and keep theirs).
    **Local**."""
    items = (
        state.items() if isinstance(state, dict)
        else enumerate(state) if isinstance(state, (list, tuple)) else ()
    )
    for k, v in list(items):
        sub = f"{key}.{k}" if key else str(k)
        if isinstance(v, (dict, list, tuple)):
            replace_values(v, saved, sub)
        elif kind_of(v) in (None, "scalar") and sub in saved and not isinstance(state, tuple):
            state[k] = saved[sub]
